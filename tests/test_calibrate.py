"""`flashflex calibrate RUN_DIR`: per-layer times fitted from a real run, and bad inputs refused."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.cost.compute import layer_times
from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.layers.schema import load_layer_profile
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.runs.reader import load_run
from tests.test_runs_compare import tiny_run


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return tiny_run(tmp_path_factory)


def test_profile_reproduces_the_measured_stage_times(made: tuple[Path, Path, Path], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    plan_file, cluster_file, run_dir = made
    out = tmp_path / "cpu.json"
    assert main(["calibrate", str(run_dir), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    profile = load_layer_profile(out)
    assert report["profiles"] == [str(out)] and profile.device_type == "cpu"
    assert "measured" in profile.source and "analytic" in profile.source
    plan, cluster, run = load_plan(plan_file), load_cluster(cluster_file), load_run(run_dir)
    pipe = plan.pipelines[0]
    fits = report["stages"]
    assert [(f["pipeline"], f["stage"]) for f in fits] == [(0, 0), (0, 1)]
    for fit, stage in zip(fits, pipe.stages, strict=True):
        s = fit["stage"]
        lt = layer_times(cluster, stage.devices, plan.inputs.model, plan.inputs.train, CostParams(), 1)
        extra_f = lt.embed_fwd_s if s == 0 else lt.head_fwd_s
        extra_b = lt.embed_bwd_s if s == 0 else lt.head_bwd_s
        slow = cluster.device(stage.devices[0]).slowdown
        measured_f = run.stage_value(0, s, "forward_s") / pipe.num_micro_batches
        measured_b = run.stage_value(0, s, "backward_s") / pipe.num_micro_batches
        # tp 1: no TP comm; by construction layer x layers x slowdown + embedding/head = measured
        assert fit["layer"]["fwd_s"] * stage.num_layers * slow + extra_f == pytest.approx(measured_f, rel=1e-9)
        assert fit["layer"]["bwd_s"] * stage.num_layers * slow + extra_b == pytest.approx(measured_b, rel=1e-9)
    (entry,) = profile.entries
    assert (entry.micro_batch_size, entry.tp) == (1, 1)
    assert entry.layer.fwd_s == pytest.approx(statistics.median(f["layer"]["fwd_s"] for f in fits))
    assert entry.layer.bwd_s == pytest.approx(statistics.median(f["layer"]["bwd_s"] for f in fits))
    assert entry.layer.activation_bytes > 0 and entry.embedding.fwd_s > 0 and entry.head.bwd_s > 0
    # the profile feeds the cost model back
    assert main(["show", str(plan_file), "--cluster", str(cluster_file), "--layers", str(out)]) == 0


def test_out_dir_writes_one_file_per_type(made: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, _, run_dir = made
    assert main(["calibrate", str(run_dir), "--out-dir", str(tmp_path / "profiles")]) == 0
    assert [p.name for p in (tmp_path / "profiles").iterdir()] == ["cpu.layers.json"]


def _no_stage_times(folder: Path, run_dir: Path) -> Path:
    bad = folder / "no-stages"
    shutil.copytree(run_dir, bad)
    rows = [json.loads(line) for line in (bad / "metrics.jsonl").read_text().splitlines()]
    (bad / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "stages"}) + "\n"
                                               for r in rows))
    return bad


def test_bad_inputs_exit_2_and_write_nothing(made: tuple[Path, Path, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _, _, run_dir = made
    out = tmp_path / "out" / "p.json"
    empty = tmp_path / "empty"
    empty.mkdir()
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    cases = [
        [str(tmp_path / "missing"), "--out", str(out)],
        [str(empty), "--out", str(out)],
        [str(_no_stage_times(tmp_path, run_dir)), "--out", str(out)],
        [str(run_dir), "--out", str(run_dir / "metrics.jsonl")],
        [str(run_dir), "--out", str(run_dir / "plan.json")],
        [str(run_dir)],
    ]
    for args in cases:
        assert main(["calibrate", *args]) == 2, args
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not out.exists() and not out.parent.exists()
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before

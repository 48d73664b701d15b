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
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
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
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_a_measured_profile_is_scaled_by_what_the_run_measured_against_it(
        made: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_file, cluster_file, run_dir = made
    plan = load_plan(plan_file)
    model, train = plan.inputs.model, plan.inputs.train
    entries = [{"micro_batch_size": m, "tp": 1, "layer": {"fwd_s": 1e-3 * m, "bwd_s": 2e-3 * m, "activation_bytes": 1e5},
                "embedding": {"fwd_s": 1e-5, "bwd_s": 1e-5}, "head": {"fwd_s": 1e-4, "bwd_s": 2e-4}}
               for m in (1, 2)]
    base = tmp_path / "base.json"
    base.write_text(json.dumps({
        "schema": "flashflex.layers/1", "device_type": "cpu",
        "model": {k: getattr(model, k) for k in ("hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                                                  "vocab_size")},
        "seq_len": train.seq_len, "dtype": train.dtype, "attention": train.attention, "entries": entries}))
    out = tmp_path / "scaled.json"
    assert main(["calibrate", str(run_dir), "--layers", str(base), "--out", str(out), "--json"]) == 0
    fits = json.loads(capsys.readouterr().out)["stages"]
    scaled = load_layer_profile(out)
    # the run's stages ran at micro-batch 1: the ratio there, median over stages, scales every entry
    r_fwd = statistics.median(f["layer"]["fwd_s"] / 1e-3 for f in fits)
    r_bwd = statistics.median(f["layer"]["bwd_s"] / 2e-3 for f in fits)
    for entry in scaled.entries:
        m = entry.micro_batch_size
        assert entry.layer.fwd_s == pytest.approx(1e-3 * m * r_fwd, rel=1e-3)
        assert entry.layer.bwd_s == pytest.approx(2e-3 * m * r_bwd, rel=1e-3)
        assert entry.layer.activation_bytes == 1e5  # bytes are not scaled
    assert "scaled by flashflex calibrate" in scaled.source
    other = json.loads(base.read_text())
    other["seq_len"] = train.seq_len * 2
    mismatched = tmp_path / "other.json"
    mismatched.write_text(json.dumps(other))
    assert main(["calibrate", str(run_dir), "--layers", str(mismatched), "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_the_run_records_memory_growth_per_stage(made: tuple[Path, Path, Path]) -> None:
    _plan, _cluster, run_dir = made
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        growth = [s["memory_growth_bytes"] for s in row["stages"]]
        # a training step allocates gradients and optimizer state at least: never zero, never above the peak
        assert all(0 < g <= s["memory_bytes"] for g, s in zip(growth, row["stages"], strict=True))
        assert row["memory_growth_bytes"] == max(growth)

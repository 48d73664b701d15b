"""A real run read back: per-op timeline, `flashflex show --run` against the prediction, `--timeline` PNG."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.schedule import simulate_1f1b
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.runs.compare import STEP_TERMS, compare_run
from flashflex_cli.runs.reader import load_run
from flashflex_cli.runs.timeline import replay_1f1b
from tests.conftest import FLASHFLEX

REPO = Path(__file__).resolve().parents[1]
STEPS, MICRO = 3, 4
TERMS = ("forward/mb", "backward/mb", "forward", "backward", "p2p", "bubble", "dp", "optimizer", "memory",
         "memory growth")


def _inputs(folder: Path) -> tuple[Path, Path]:
    """A 2-device emulated cluster (slowdown 1 and 2) and a 2-stage llama-tiny plan for it."""
    cluster = json.loads((REPO / "profiles" / "cpu-emulated.json").read_text())
    devices = cluster["nodes"][0]["devices"][:2]
    devices[0]["slowdown"], devices[1]["slowdown"] = 1.0, 2.0
    cluster["nodes"][0]["devices"] = devices
    cluster["name"] = "cpu-2"
    (folder / "cluster.json").write_text(json.dumps(cluster))
    plan = {"schema": "flashflex.plan/1",
            "inputs": {"cluster_sha256": load_cluster(folder / "cluster.json").sha256(), "cluster_name": "cpu-2",
                       "model": PRESETS["llama-tiny"].model_dump(),
                       "train": {"global_batch": MICRO, "seq_len": 32, "micro_batch_size": 1, "dtype": "fp32"}},
            "pipelines": [{"micro_batch_size": 1, "num_micro_batches": MICRO,
                           "stages": [{"devices": ["node0/0"], "tp": 1, "layers": [0, 2]},
                                      {"devices": ["node0/1"], "tp": 1, "layers": [2, 4]}]}]}
    (folder / "plan.json").write_text(json.dumps(plan))
    return folder / "plan.json", folder / "cluster.json"


def tiny_run(factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(plan, cluster, run folder) of a 3-step run, made once per test session (reused by test_calibrate)."""
    base = factory.getbasetemp() / "tiny-run"
    run = base / "run"
    if not (run / "metrics.jsonl").is_file():
        base.mkdir(exist_ok=True)
        plan, cluster = _inputs(base)
        done = subprocess.run([FLASHFLEX, "launch", str(plan), "--cluster", str(cluster), "--out", str(run),
                               "--steps", str(STEPS), "--timeout", "60"], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
    return base / "plan.json", base / "cluster.json", run


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return tiny_run(tmp_path_factory)


def test_timeline_has_every_op_ordered_and_not_overlapping(made: tuple[Path, Path, Path]) -> None:
    _, _, run = made
    rows = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
    assert sorted((r["pipeline"], r["stage"]) for r in rows) == [(0, 0), (0, 1)]
    for row in rows:
        ops = row["ops"]
        assert sorted((k, i) for k, i, _, _ in ops) == sorted((k, i) for k in "FB" for i in range(MICRO))
        for (_, _, a, b), (_, _, c, _) in zip(ops, ops[1:], strict=False):
            assert 0 <= a <= b <= c
    assert (run / "plan.json").is_file() and (run / "cluster.json").is_file()


def test_compare_run_covers_every_stage_and_term(made: tuple[Path, Path, Path]) -> None:
    plan_file, cluster_file, run_dir = made
    plan = load_plan(plan_file)
    cmp = compare_run(plan, estimate(plan, load_cluster(cluster_file)), load_run(run_dir))
    assert [(s.pipeline, s.stage) for s in cmp.stages] == [(0, 0), (0, 1)]
    for sc in cmp.stages:
        assert tuple(t.name for t in sc.terms) == TERMS
        for t in sc.terms:
            assert t.measured is not None and t.predicted >= 0
            assert t.measured > 0 or t.name == "dp"  # one pipeline: the DP reduction may round to 0
    assert cmp.steps_used == STEPS - 1 and cmp.measured_step_s > 0
    assert cmp.worst is not None and cmp.worst[2] in STEP_TERMS


def test_show_run_table_and_json(made: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    plan, cluster, run = made
    assert main(["show", str(plan), "--cluster", str(cluster), "--run", str(run), "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["schema"] == "flashflex.plan/1"
    stages = data["run_comparison"]["stages"]
    assert [(s["pipeline"], s["stage"]) for s in stages] == [(0, 0), (0, 1)]
    for stage in stages:
        assert [t["term"] for t in stage["terms"]] == list(TERMS)
        assert all(t["measured"] is not None and (t["measured"] > 0 or t["term"] == "dp") for t in stage["terms"])
    assert data["run_comparison"]["off_most"]["term"] in STEP_TERMS
    assert "measured/predicted" in captured.err and "off most" in captured.err  # --json: the tables on stderr
    assert "p0.s1" in captured.err


def test_show_run_takes_the_cluster_from_the_run(made: tuple[Path, Path, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    plan, _, run = made
    assert main(["show", str(plan), "--run", str(run)]) == 0
    assert "off most" in capsys.readouterr().out


def test_show_run_bad_inputs_exit_2(made: tuple[Path, Path, Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    plan, cluster, _ = made
    assert main(["show", str(plan), "--cluster", str(cluster), "--run", str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["show", str(plan), "--cluster", str(cluster), "--run", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "no such run folder" in err and "no metrics.jsonl" in err


def test_replay_matches_the_schedule_simulation() -> None:
    fwd, bwd, p2p, m = [1.0, 2.0, 1.5], [2.0, 3.5, 3.0], [0.25, 0.5], 5
    ops = replay_1f1b(fwd, bwd, p2p, m)
    sim = simulate_1f1b(fwd, bwd, p2p, m)
    assert max(op[3] for stage in ops for op in stage) == pytest.approx(sim.total_s)
    assert [max(op[3] for op in stage if op[0] == "B") for stage in ops] == pytest.approx(sim.last_backward_end_s)


def test_timeline_png(made: tuple[Path, Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="--timeline needs the optional matplotlib (flashflex[plot])")
    plan, cluster, run = made
    out = tmp_path / "t.png"
    assert main(["show", str(plan), "--cluster", str(cluster), "--run", str(run), "--timeline", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    predicted_only = tmp_path / "p.png"
    assert main(["show", str(plan), "--cluster", str(cluster), "--timeline", str(predicted_only)]) == 0
    assert predicted_only.read_bytes()[:4] == b"\x89PNG"


def test_timeline_without_matplotlib_says_so(made: tuple[Path, Path, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    plan, cluster, run = made
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    out = tmp_path / "t.png"
    assert main(["show", str(plan), "--cluster", str(cluster), "--run", str(run), "--timeline", str(out)]) == 2
    assert "--timeline needs matplotlib: pip install 'flashflex[plot]'" in capsys.readouterr().err
    assert not out.exists()


def test_a_term_predicted_as_nothing_has_no_ratio() -> None:
    """A predicted bubble of 1e-16 s is a sum that rounds, not a prediction: no ratio (a printed 1e14 helps no one)."""
    from flashflex_cli.runs.compare import Term

    assert Term("bubble", 1e-16, 0.013).ratio is None and Term("bubble", 0.0, 0.013).ratio is None
    assert Term("forward", 0.1, 0.12).ratio == pytest.approx(1.2)
    assert Term("memory", 0.5, 100.0, unit="B").ratio is None and Term("memory", 2.0, 3.0, unit="B").ratio == 1.5

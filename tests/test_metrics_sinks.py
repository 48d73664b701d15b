"""Metrics sinks (runtime/training/sinks/, `flashflex launch --metrics`): a real launch writes its rows to TensorBoard
with the same values as metrics.jsonl, the choice is recorded in RUN/config.json, and an unknown sink or one whose
package is missing is refused in one line before anything starts or is written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.errors import InputError
from flashflex_cli.run_config import load_run_config
from flashflex_cli.runtime.training.metrics import MetricsLog
from flashflex_cli.runtime.training.sinks import scalars
from flashflex_cli.runtime.training.sinks.tensorboard import TensorBoardSink
from flashflex_cli.semantics import metrics_sinks
from flashflex_cli.semantics.metrics_sinks import SINKS, missing_package, parse_sinks
from tests.test_launch import GOLDEN, _launch, _rows

STEPS = 2


def _event_series(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the TensorBoard event files in `folder`: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(str(files[0]))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_launch_writes_tensorboard_scalars_equal_to_the_jsonl_rows(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    result = _launch("plan-1rank.json", out, "--steps", str(STEPS), "--no-checkpoint", "--metrics",
                     "tensorboard,jsonl")
    assert result.returncode == 0, result.stderr
    assert load_run_config(out / "config.json").metrics == ("jsonl", "tensorboard")
    assert json.loads((out / "config.json").read_text())["metrics"] == ["jsonl", "tensorboard"]
    rows = _rows(out)
    assert [row["step"] for row in rows] == [1, 2]
    assert "step    1/2" not in result.stderr  # no console sink chosen
    series = _event_series(out / "tensorboard")
    for key, tag in (("loss", "train/loss"), ("tokens_per_s", "train/tokens_per_s"), ("mfu", "train/mfu"),
                     ("step_time_s", "train/step_time_s"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("memory_bytes", "train/memory_bytes")):
        assert [step for step, _ in series[tag]] == [1, 2], tag
        # TensorBoard keeps scalars in float32: equal to the row's value within float32's precision
        assert [value for _, value in series[tag]] == pytest.approx([float(row[key]) for row in rows], rel=1e-6), tag


def _refused(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code = main(["launch", str(GOLDEN / "plan-1rank.json"), "--cluster", str(GOLDEN / "cluster-2node.json"),
                 "--out", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not out.exists()  # nothing written, nothing started
    return err[0]


@pytest.mark.parametrize(("text", "problem"), [
    ("jsonl,csv", "--metrics 'csv' is no metrics sink (known: jsonl, console, tensorboard, wandb)"),
    ("console,", "--metrics an empty name is no metrics sink"),
    ("console,console", "--metrics names console twice"),
])
def test_an_unknown_sink_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str,
                                                problem: str) -> None:
    for launcher in ("local", "torchrun"):
        line = _refused(["--metrics", text, "--launcher", launcher], tmp_path / launcher, capsys)
        assert line.startswith(f"error: {problem}"), line


def test_a_sink_whose_package_is_missing_is_refused_before_the_launch(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(metrics_sinks.PACKAGES, "tensorboard", "flashflex_test_no_such_package")
    line = _refused(["--metrics", "jsonl,tensorboard"], tmp_path / "run", capsys)
    assert line == ("error: --metrics tensorboard needs the flashflex_test_no_such_package package, which is not "
                    "installed: pip install 'flashflex[tensorboard]' (or pip install flashflex_test_no_such_package)")
    if missing_package("wandb") is not None:  # the real case, where wandb is not installed
        line = _refused(["--metrics", "wandb"], tmp_path / "run", capsys)
        assert "--metrics wandb needs the wandb package" in line


def test_a_worker_without_the_package_refuses_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A rendered script's host lacking tensorboard: the sink's import fails, one InputError line (exit 2)."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # an import of it now raises ImportError
    with pytest.raises(InputError, match=r"^metrics sink tensorboard needs the tensorboard package"):
        TensorBoardSink(tmp_path / "tensorboard")
    with pytest.raises(InputError, match="tensorboard"):
        MetricsLog(tmp_path, total_steps=2, flops_per_token=1.0, peak_flops=1.0, sinks=("jsonl", "tensorboard"))


def test_jsonl_is_always_written_and_quiet_drops_the_console(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    log = MetricsLog(tmp_path, total_steps=1, flops_per_token=1.0, peak_flops=1.0, sinks=("console",), quiet=True)
    row = log.record(1, 2.5, tokens=8, step_time_s=0.5, lr=1e-3, grad_norm=0.25, memory_bytes=1024, stages=[])
    log.close()
    assert capsys.readouterr().err == ""
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [row]


def test_the_scalar_tags_are_stable() -> None:
    row = {"step": 3, "loss": 2.5, "tokens_per_s": 100.0, "mfu": 0.1, "step_time_s": 0.5, "lr": 1e-3,
           "grad_norm": 0.25, "memory_bytes": 1024, "tokens": 50, "stages": []}
    assert scalars(row) == {"train/loss": 2.5, "train/tokens_per_s": 100.0, "train/mfu": 0.1,
                            "train/step_time_s": 0.5, "train/lr": 1e-3, "train/grad_norm": 0.25,
                            "train/memory_bytes": 1024.0}
    assert scalars({**row, "loss_scale": 8.0})["train/loss_scale"] == 8.0
    assert parse_sinks("wandb, console") == ("jsonl", "console", "wandb") and SINKS[0] == "jsonl"

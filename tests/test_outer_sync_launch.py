"""A plan of replica groups through `flashflex launch` (local): rounds in metrics.jsonl, checkpoints at round
ends that resume, and a step count that is not a whole number of rounds refused (exit 2, one line)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"


def grouped_plan(tmp_path: Path) -> Path:
    """The golden 4-rank plan (pipeline 0: TP-2 + TP-1 stages; pipeline 1: one stage) as two replica groups of
    2 inner steps per round."""
    data = json.loads((GOLDEN / "plan-4rank.json").read_text())
    data["outer_sync"] = {"groups": [{"pipelines": [0], "inner_steps": 2}, {"pipelines": [1], "inner_steps": 2}]}
    path = tmp_path / "grouped.json"
    path.write_text(json.dumps(data))
    return path


def launch(plan: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLASHFLEX, "launch", str(plan), "--cluster", str(GOLDEN / "cluster-2node.json"),
                           "--out", str(out), "--timeout", "60", *extra], capture_output=True, text=True,
                          timeout=300, env={**os.environ})


@pytest.mark.slow
def test_rounds_run_checkpoint_and_resume(tmp_path: Path) -> None:
    plan, out = grouped_plan(tmp_path), tmp_path / "run"
    done = launch(plan, out, "--steps", "4", "--checkpoint-every", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    assert all(r["tokens"] == 2 * 2 * 4 * 32 for r in rows)  # 2 groups x 2 inner steps x 4 sequences x 32
    assert (out / "checkpoints" / "step-000004").is_dir()
    again = launch(plan, out, "--steps", "6", "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 6


def test_steps_not_whole_rounds_are_refused(tmp_path: Path) -> None:
    done = launch(grouped_plan(tmp_path), tmp_path / "run", "--steps", "3")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "whole numbers of rounds" in done.stderr and len(done.stderr.strip().splitlines()) == 1

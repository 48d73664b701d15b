"""A second launch into a used run folder, end to end (real workers): the issue's sequence (10 steps with a
checkpoint every step, then the same command with `--steps 3` and no --resume) and its variants: the same command
again, more steps, another plan, --resume, --overwrite, and a Ctrl-C in between. Progress is never lost: metrics
are appended, `latest` never moves back, and every refusal is one line naming --resume and --overwrite."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = str(GOLDEN / "cluster-2node.json")
HANG_GUARD_S = 120


def _launch(plan: str, run: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([FLASHFLEX, "launch", str(GOLDEN / plan), "--cluster", CLUSTER, "--out", str(run),
                           "--steps", str(steps), "--checkpoint-every", "1", "--timeout", "30", *extra],
                          capture_output=True, text=True, timeout=240)


def _steps(run: Path) -> list[tuple[int, int]]:
    """(step, launch) of every metrics row, in file order."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["launch"]) for row in rows]


def _latest(run: Path) -> str:
    return (run / "checkpoints" / "latest").read_text().strip()


def _refused(result: subprocess.CompletedProcess, words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "--resume" in lines[0] and "--overwrite" in lines[0], lines


@pytest.mark.slow
def test_a_rerun_never_loses_progress(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _launch("plan-1rank.json", run, 4)
    assert first.returncode == 0, first.stderr
    assert _steps(run) == [(1, 0), (2, 0), (3, 0), (4, 0)] and _latest(run) == "step-000004"
    summary = first.stdout  # the run's summary is the launch's result
    assert "done: steps 1-4 of 4" in summary and "checkpoint: " in summary and "step-000004" in summary
    assert summary.count("metrics.jsonl") == 1

    fewer = _launch("plan-1rank.json", run, 3)  # the command: fewer steps, no --resume
    _refused(fewer, "beyond --steps 3")
    assert _steps(run) == [(1, 0), (2, 0), (3, 0), (4, 0)] and _latest(run) == "step-000004"

    again = _launch("plan-1rank.json", run, 4)  # the same command again: complete, nothing to train
    assert again.returncode == 0 and "nothing to train" in again.stderr, again.stderr
    assert len(_steps(run)) == 4

    more = _launch("plan-1rank.json", run, 6)  # another --steps is another learning-rate schedule
    _refused(more, "another learning-rate schedule length (4 steps, this launch 6)")

    other = _launch("plan-3rank.json", run, 6, "--schedule-steps", "4")
    _refused(other, "another plan")

    resumed = _launch("plan-3rank.json", run, 6, "--resume")  # continues under the other plan, appending
    assert resumed.returncode == 0, resumed.stderr
    assert _steps(run) == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1)] and _latest(run) == "step-000006"
    assert "done: steps 5-6 of 6" in resumed.stdout

    both = _launch("plan-1rank.json", run, 3, "--resume", "--overwrite")
    assert both.returncode == 2 and "contradict" in both.stderr

    again = _launch("plan-1rank.json", run, 3, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert _steps(run) == [(1, 0), (2, 0), (3, 0)] and _latest(run) == "step-000003"
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-")) == \
        ["step-000002", "step-000003"]


@pytest.mark.slow
def test_a_run_stopped_by_ctrl_c_continues_with_the_same_command(tmp_path: Path) -> None:
    run = tmp_path / "run"
    command = [FLASHFLEX, "launch", str(GOLDEN / "plan-1rank.json"), "--cluster", CLUSTER, "--out", str(run),
               "--steps", "40", "--timeout", "30"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and not (run / "metrics.jsonl").is_file() or len(_steps(run)) < 2:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no second step in time"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the launcher and its workers
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 130, err
    stopped = _steps(run)
    done = int(_latest(run).removeprefix("step-"))
    assert done == stopped[-1][0] and 2 <= done < 40  # saved at the step the stop came after

    again = subprocess.run(command, capture_output=True, text=True, timeout=240)  # the same command
    assert again.returncode == 0, again.stderr
    assert "resuming" in again.stderr and f"done: steps {done + 1}-40 of 40" in again.stdout
    steps = _steps(run)
    assert [s for s, _ in steps] == list(range(1, 41)) and {launch for s, launch in steps if s > done} == {1}
    assert _latest(run) == "step-000040"

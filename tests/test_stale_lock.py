"""A lock file left by a killed launcher (launch/lock.py): the next launch takes it over and says so in one
line, `show --run` says so in one line, and a launcher that ends by itself leaves no record behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.launch.lock import run_lock, stale_lock_note

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = str(GOLDEN / "cluster-2node.json")
HOLD = """
import sys, time
from flashflex_cli.launch.lock import run_lock
with run_lock(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None):
    print("locked", flush=True)
    time.sleep(600)
"""


def _killed_launcher(*folders: Path) -> int:
    """The pid of a process that locked `folders` as a launcher does and was then killed (SIGKILL, reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, *map(str, folders)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    return proc.pid


def test_the_next_launch_and_show_name_a_killed_launchers_lock(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    pid = _killed_launcher(run, run / "checkpoints")
    assert json.loads((run / ".lock").read_text())["pid"] == pid  # its record stays: it never let go
    assert stale_lock_note(run) == (f"lock {run}/.lock left by process {pid}, which is gone: that launch was "
                                    "killed, and its run ends where it stopped")
    capsys.readouterr()
    assert main(["launch", str(GOLDEN / "plan-1rank.json"), "--cluster", CLUSTER, "--out", str(run),
                 "--steps", "1"]) == 0  # a real local launch: it proceeds
    err = capsys.readouterr().err
    taken = [line for line in err.splitlines() if "left by process" in line]
    assert taken == [f"lock {run}/.lock and {run}/checkpoints/.lock left by process {pid}, which is gone; taking "
                     "them over"], err
    assert json.loads((run / ".lock").read_text())["released"] and stale_lock_note(run) is None  # released by a launcher that ended
    again = _killed_launcher(run)
    assert main(["show", str(run)]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "left by process" in line]
    assert notes == [f"lock {run}/.lock left by process {again}, which is gone: that launch was killed, and its "
                     "run ends where it stopped"]


def test_a_held_lock_is_no_stale_one_and_a_released_one_is_marked_released(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with run_lock(run, None) as lock:
        assert lock.notes == ()
        assert stale_lock_note(run) is None  # a running launch holds it
    assert json.loads((run / ".lock").read_text())["released"] and stale_lock_note(run) is None
    with run_lock(run, None) as lock:
        assert lock.notes == ()

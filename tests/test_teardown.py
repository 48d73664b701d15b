"""A rank whose training is over is never reported frozen while it tears down, and teardown is bounded.

Under a heavily loaded host a worker's exit (interpreter and gloo teardown, after its heartbeat thread has
stopped) was once read by the launcher as a frozen rank, failing a finished job. The worker now says it is done
(heartbeat.mark_done) after its last collective and exits without teardown (worker.exit_now); the launcher
exempts done ranks from the heartbeat check and kills one that lingers, counting its work as complete.
Real processes stand in for workers here: `sleep`, whose heartbeat never beats.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from flashflex_cli.launch.local import FAILURE_GRACE_S, LocalJob, Worker
from flashflex_cli.launch.options import launch_config
from flashflex_cli.runtime.training import heartbeat
from flashflex_cli.semantics import worker_protocol

TIMEOUT_S = 5.0  # the launcher's smallest silence limit (worker_protocol.MIN_SILENCE_S)


def _job(tmp_path: Path) -> tuple[LocalJob, Worker]:
    job = LocalJob(launch_config(plan="p.json", cluster="c.json", out=str(tmp_path / "run"), timeout_s=TIMEOUT_S),
                   str(tmp_path))
    proc = subprocess.Popen(["sleep", "60"])
    long_ago = time.time() - 10 * TIMEOUT_S  # no heartbeat for far longer than the silence limit
    worker = Worker(0, proc, since=long_ago)
    job.workers.append(worker)
    return job, worker


def _age(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_a_silent_rank_that_is_not_done_is_frozen(tmp_path: Path) -> None:
    job, worker = _job(tmp_path)
    job.check_health()
    worker.proc.wait(timeout=30)
    job.reap()
    assert worker.silent is not None and job.failures()[0].silent


def test_a_done_rank_tearing_down_is_not_frozen(tmp_path: Path) -> None:
    job, worker = _job(tmp_path)
    worker_protocol.done_file(tmp_path, 0).touch()  # done just now, heartbeat long silent
    job.check_health()
    assert worker.proc.poll() is None and worker.silent is None and not job.failing
    worker.proc.kill()
    worker.proc.wait(timeout=30)


def test_a_done_rank_that_lingers_is_killed_and_its_work_counts(tmp_path: Path, capfd) -> None:
    job, worker = _job(tmp_path)
    done = worker_protocol.done_file(tmp_path, 0)
    done.touch()
    _age(done, worker_protocol.silence_limit(TIMEOUT_S) + FAILURE_GRACE_S + 1.0)
    job.check_health()
    worker.proc.wait(timeout=30)
    job.reap()
    assert job.exits[0].exitcode == 0 and not job.failures()
    assert "finished training but did not exit in time" in capfd.readouterr().err


def test_mark_done_writes_the_launchers_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(worker_protocol.JOB_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert worker_protocol.finished_at(tmp_path, 3) is None
    heartbeat.mark_done()
    assert worker_protocol.finished_at(tmp_path, 3) is not None


def test_exit_now_flushes_and_skips_teardown(tmp_path: Path) -> None:
    """Buffered output reaches the pipe, the code is kept, and atexit handlers (teardown) do not run."""
    code = ("import atexit, sys\n"
            "from flashflex_cli.runtime.training.worker import exit_now\n"
            "atexit.register(lambda: print('TEARDOWN', flush=True))\n"
            "sys.stdout.write('last words')\n"
            "exit_now(7)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7 and proc.stdout == "last words"

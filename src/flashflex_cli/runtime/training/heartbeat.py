"""A worker's ties to the local launcher (launch/local.py): parent death, a heartbeat file, a one-line error.

The local launcher gives each worker FLASHFLEX_JOB_DIR (a private folder of the job), FLASHFLEX_LAUNCHER_PID
and FLASHFLEX_HEARTBEAT_S. `start()` then, first thing in the worker:
- asks the kernel for SIGKILL when the launcher dies (Linux `prctl(PR_SET_PDEATHSIG)`), and exits at once
  when the launcher died before that request (its parent pid changed);
- touches JOB_DIR/rank-L.alive every FLASHFLEX_HEARTBEAT_S seconds from a daemon thread (L: LOCAL_RANK). The
  thread beats while the rank computes or waits in a collective, and stops only when the whole process is
  frozen (SIGSTOP, a debugger, a hung kernel call): the launcher then ends the job naming that rank. The
  thread also exits the process when its parent changed (a second guard where prctl is missing).
`report_error(text)` leaves the worker's one-line failure in JOB_DIR/rank-L.error for the launcher's last line.
`mark_done()` leaves JOB_DIR/rank-L.done once the rank's training is over: from then on the launcher no longer
reads silence as a freeze (a process's teardown runs after its Python threads have stopped), only bounds how
long the rank may take to exit.
Under torchrun or SLURM these variables are unset and nothing happens. The files' names and how the launcher
reads them: semantics/worker_protocol.py.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path

from ...semantics.worker_protocol import (
    INTERVAL_ENV,
    JOB_DIR_ENV,
    LAUNCHER_PID_ENV,
    alive_file,
    done_file,
    error_file,
    say,
)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
ORPHANED = 1


def _exit_if_orphaned(parent_pid: int) -> None:
    """End this process at once when `parent_pid` is no longer its parent (the launcher died)."""
    if os.getppid() != parent_pid:
        say(f"flashflex worker: its launcher (pid {parent_pid}) is gone; exiting")
        os._exit(ORPHANED)


def die_with_parent(parent_pid: int) -> None:
    """Ask for SIGKILL when the parent dies (Linux), then check the parent is still `parent_pid`."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the heartbeat thread's parent check remains
    _exit_if_orphaned(parent_pid)


def _beat(path: Path, interval: float, parent_pid: int) -> None:
    """The heartbeat thread's loop."""
    while True:
        _exit_if_orphaned(parent_pid)
        try:
            path.touch()
        except OSError:
            pass  # the launcher removed its folder: it is ending the job
        time.sleep(interval)


def under_local_launcher() -> bool:
    """True in a worker that `flashflex launch` started on this host (which prints the run's summary itself)."""
    return bool(os.environ.get(JOB_DIR_ENV) and os.environ.get(LAUNCHER_PID_ENV))


def start() -> None:
    """Tie this worker to the local launcher that started it (see the module docstring); else do nothing."""
    job_dir, parent = os.environ.get(JOB_DIR_ENV), os.environ.get(LAUNCHER_PID_ENV)
    if not job_dir or not parent:
        return
    die_with_parent(int(parent))
    path = alive_file(job_dir, int(os.environ.get("LOCAL_RANK", "0")))
    interval = float(os.environ.get(INTERVAL_ENV, "2"))
    threading.Thread(target=_beat, args=(path, interval, int(parent)), name="flashflex-heartbeat",
                     daemon=True).start()


def report_error(text: str) -> None:
    """Leave `text` (one line) for the local launcher's report; nothing outside a local launch."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir:
        return
    try:
        error_file(job_dir, int(os.environ.get("LOCAL_RANK", "0"))).write_text(text + "\n", encoding="utf-8")
    except OSError:
        pass


def mark_done() -> None:
    """Tell the local launcher this rank's training is over (nothing outside a local launch)."""
    job_dir = os.environ.get(JOB_DIR_ENV)
    if not job_dir:
        return
    try:
        done_file(job_dir, int(os.environ.get("LOCAL_RANK", "0"))).touch()
    except OSError:
        pass  # the launcher removed its folder: it is ending the job

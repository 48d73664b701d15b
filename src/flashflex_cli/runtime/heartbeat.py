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
Under torchrun or SLURM these variables are unset and nothing happens. No torch here: the launcher reads the
same files.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

JOB_DIR_ENV = "FLASHFLEX_JOB_DIR"
LAUNCHER_PID_ENV = "FLASHFLEX_LAUNCHER_PID"
INTERVAL_ENV = "FLASHFLEX_HEARTBEAT_S"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
MIN_SILENCE_S = 5.0  # a worker's first `import torch` may hold the interpreter lock for a second or two
ORPHANED = 1


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between two heartbeats: a fifth of the collective timeout, between 0.2 and 2 s."""
    return min(2.0, max(0.2, timeout_s / 5))


def silence_limit(timeout_s: float) -> float:
    """Age of a rank's newest heartbeat at which the launcher ends the job: the timeout, at least 5 s."""
    return max(timeout_s, MIN_SILENCE_S)


def alive_file(job_dir: str | os.PathLike[str], local_rank: int) -> Path:
    """The file whose modification time is local rank `local_rank`'s last heartbeat."""
    return Path(job_dir) / f"rank-{local_rank}.alive"


def error_file(job_dir: str | os.PathLike[str], local_rank: int) -> Path:
    """The file holding local rank `local_rank`'s one-line failure."""
    return Path(job_dir) / f"rank-{local_rank}.error"


def done_file(job_dir: str | os.PathLike[str], local_rank: int) -> Path:
    """The file whose existence says local rank `local_rank` finished its training (mtime: when)."""
    return Path(job_dir) / f"rank-{local_rank}.done"


def finished_at(job_dir: str | os.PathLike[str], local_rank: int) -> float | None:
    """When (`time.time()`) local rank `local_rank` said its training was over; None while it has not."""
    try:
        return os.stat(done_file(job_dir, local_rank)).st_mtime
    except OSError:
        return None


def heartbeat_age(job_dir: str | os.PathLike[str], local_rank: int, started: float) -> float:
    """Seconds since the last heartbeat of `local_rank` (since `started`, a `time.time()`, before its first)."""
    try:
        last = os.stat(alive_file(job_dir, local_rank)).st_mtime
    except OSError:
        last = started
    return time.time() - max(last, started)


def read_error(job_dir: str | os.PathLike[str], local_rank: int) -> str | None:
    """The one-line failure `local_rank` reported, None when it reported none."""
    try:
        text = error_file(job_dir, local_rank).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return text.splitlines()[0] if text else None


def _exit_if_orphaned(parent_pid: int) -> None:
    """End this process at once when `parent_pid` is no longer its parent (the launcher died)."""
    if os.getppid() != parent_pid:
        print(f"flashflex worker: its launcher (pid {parent_pid}) is gone; exiting", file=sys.stderr, flush=True)
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

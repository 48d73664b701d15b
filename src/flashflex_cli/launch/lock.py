"""An advisory lock on the run folder (and the checkpoint folder) while a local launch uses it.

`FOLDER/.lock` is locked with `fcntl.flock` before any worker starts and holds the launcher's pid, host and
start time (JSON). A second launch into the same folder fails at once with one line naming them (exit 2).
The lock belongs to the open file, which the workers inherit: it is released when the last process of the
job ends, however it ends (SIGKILL included), so a lock file left by a finished or dead job never blocks a
new launch or a `--resume`. The file is never removed: removing it would let two launches lock two
different files of the same name.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

LOCK_NAME = ".lock"


@dataclass(frozen=True)
class RunLock:
    """The locked files of one launch (open descriptors, passed on to the workers)."""

    fds: tuple[int, ...]


def _holder_text(fd: int) -> str:
    """"pid N on host H since T" from a lock file's content, or a hint when it is not written yet."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        return f"pid {int(data['pid'])} on host {data['host']}, started {data['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown: the lock was just taken"


def _write_holder(fd: int) -> None:
    """Record this process as the holder."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}) + "\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode("utf-8"), 0)


def lock_folder(folder: str | os.PathLike[str], what: str) -> int:
    """Create `folder` if needed and lock `folder/.lock`; returns the open descriptor (InputError when a running
    launch holds it, naming its pid and host)."""
    path = Path(folder) / LOCK_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise InputError(f"{what} {folder}: cannot create the lock file {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_text(fd)
        os.close(fd)
        raise InputError(f"{what} {folder} is in use by a running launch ({holder}); wait for it to end, stop "
                         f"it, or choose another {what}") from None
    except OSError as exc:
        os.close(fd)
        raise InputError(f"{what} {folder}: cannot lock {path}: {exc.strerror or exc}") from None
    _write_holder(fd)
    return fd


@contextmanager
def run_lock(out: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str] | None) -> Iterator[RunLock]:
    """Hold the locks of the run folder and the checkpoint folder (one lock when they are the same folder)."""
    fds: list[int] = []
    seen: set[str] = set()
    try:
        for folder, what in ((out, "--out"), (checkpoint_dir, "--checkpoint-dir")):
            if folder is None or os.path.realpath(folder) in seen:
                continue
            fds.append(lock_folder(folder, what))
            seen.add(os.path.realpath(folder))
        yield RunLock(tuple(fds))
    finally:
        for fd in fds:
            os.close(fd)

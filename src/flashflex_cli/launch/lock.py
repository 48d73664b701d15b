"""An advisory lock on the run folder (and the checkpoint folder) while a local launch uses it.

`FOLDER/.lock` is locked with `fcntl.flock` before any worker starts and holds the launcher's pid, host and
start time (JSON). A second launch into the same folder fails at once with one line naming them (exit 2).
The lock belongs to the open file, which the workers inherit: it is released when the last process of the
job ends, however it ends (SIGKILL included), so a lock file left by a finished or dead job never blocks a
new launch or a `--resume`. The file is never removed: removing it would let two launches lock two
different files of the same name. A launcher that ends by itself marks its record released as it lets go; one
that was killed leaves its record unreleased, which the next launch (taking the lock over) and `flashflex show --run`
(`stale_lock_note`) report in one line.
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
    """The locked files of one launch (open descriptors, passed on to the workers), and one line for each lock
    it took over from a killed launcher."""

    fds: tuple[int, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Holder:
    """The launcher a lock file names: its pid, host and start time (UTC, ISO 8601)."""

    pid: int
    host: str
    started: str

    def is_gone(self) -> bool | None:
        """True when no process of this pid runs on this host; None when the holder ran on another host."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's process of that pid
            return False
        return _is_zombie(self.pid)

    def left_by(self) -> str:
        """"process N, which is gone" (or "process N on host H") for a lock this holder did not release."""
        gone = self.is_gone()
        if gone is None:
            return f"process {self.pid} on host {self.host}, which no longer holds it"
        return f"process {self.pid}, which is gone" if gone else f"process {self.pid}, which no longer holds it"


def _is_zombie(pid: int) -> bool:
    """True when `pid` has exited but was not reaped yet (Linux /proc; False where it cannot be read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _holder(fd: int) -> Holder | None:
    """The holder a lock file's content names; None when it released the lock, or the content is no holder
    record (empty: just created)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        if data.get("released"):
            return None
        return Holder(int(data["pid"]), str(data["host"]), str(data["started"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _holder_text(fd: int) -> str:
    """"pid N on host H since T" from a lock file's content, or a hint when it is not written yet."""
    holder = _holder(fd)
    if holder is None:
        return "pid unknown: the lock was just taken"
    return f"pid {holder.pid} on host {holder.host}, started {holder.started}"


def _write_holder(fd: int) -> None:
    """Record this process as the holder."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}) + "\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode("utf-8"), 0)


def lock_folder(folder: str | os.PathLike[str], what: str) -> tuple[int, Holder | None]:
    """Create `folder` if needed and lock `folder/.lock`; returns the open descriptor and the launcher a killed
    launch left recorded there (None: none; InputError when a running launch holds it, naming its pid and host)."""
    path = Path(folder) / LOCK_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise InputError(f"{what} {folder}: cannot create the lock file {path}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder, text = _holder(fd), _holder_text(fd)
        os.close(fd)
        if holder is not None and holder.is_gone():  # its workers inherited the lock and still run
            raise InputError(f"{what} {folder} is in use by the workers of a launch whose launcher ({text}) is "
                             f"gone; stop them, or choose another {what}") from None
        raise InputError(f"{what} {folder} is in use by a running launch ({text}); wait for it to end, stop "
                         f"it, or choose another {what}") from None
    except OSError as exc:
        os.close(fd)
        raise InputError(f"{what} {folder}: cannot lock {path}: {exc.strerror or exc}") from None
    left = _holder(fd)
    _write_holder(fd)
    return fd, left


def _release(fd: int) -> None:
    """Mark the lock file's record released (a launcher that ends by itself leaves no holder behind, its pid kept
    for whoever reads the file) and close it."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
        text = json.dumps({**data, "released": True})
        os.pwrite(fd, text.encode("utf-8"), 0)
        os.ftruncate(fd, len(text.encode("utf-8")))
    except (OSError, ValueError, TypeError):
        pass
    os.close(fd)


def stale_lock_note(folder: str | os.PathLike[str]) -> str | None:
    """One line when `folder/.lock` names a launcher that did not release it and no process holds it any more
    (the launch was killed); None when there is no such record, or a launch holds the lock now."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        holder = _holder(fd)
        if holder is None:
            return None
        try:  # a shared lock, at once released: free means no launch holds the folder
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return f"lock {path} left by {holder.left_by()}: that launch was killed, and its run ends where it stopped"
    finally:
        os.close(fd)


@contextmanager
def run_lock(out: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str] | None) -> Iterator[RunLock]:
    """Hold the locks of the run folder and the checkpoint folder (one lock when they are the same folder)."""
    fds: list[int] = []
    left: dict[Holder, list[str]] = {}  # a killed launcher's record, and the lock files it was left in
    seen: set[str] = set()
    try:
        for folder, what in ((out, "--out"), (checkpoint_dir, "--checkpoint-dir")):
            if folder is None or os.path.realpath(folder) in seen:
                continue
            fd, holder = lock_folder(folder, what)
            fds.append(fd)
            if holder is not None:
                left.setdefault(holder, []).append(str(Path(folder) / LOCK_NAME))
            seen.add(os.path.realpath(folder))
        notes = tuple(f"lock {' and '.join(paths)} left by {holder.left_by()}; taking "
                      f"{'them' if len(paths) > 1 else 'it'} over" for holder, paths in left.items())
        yield RunLock(tuple(fds), notes)
    finally:
        for fd in fds:
            _release(fd)

"""The launcher-worker protocol: everything `flashflex launch` (launch/) and its workers (runtime/) agree on that is not
a file of the run folder (those are semantics/run_folder.py). Torch-free: the launcher reads it without importing
torch or DCP.

- Heartbeat files. The local launcher gives each worker FLASHFLEX_JOB_DIR (a private folder of the job),
  FLASHFLEX_LAUNCHER_PID and FLASHFLEX_HEARTBEAT_S; a worker touches JOB_DIR/rank-L.alive every interval (L: its
  LOCAL_RANK), leaves its one-line failure in JOB_DIR/rank-L.error and marks the end of its training with
  JOB_DIR/rank-L.done (the worker's side: runtime/training/heartbeat.py; the launcher's: launch/local.py).
- Exit codes and failure lines: a rank that stopped because a peer failed exits with PEER_LOST, so the launcher
  blames the peer; a rank out of memory reports one line starting with OOM_LINE_PREFIX
  (runtime/device/oom.py writes it), which the launcher's report quotes as the root cause.
- Lines on the shared stderr: the launcher and every worker write to one inherited stderr, so each line goes out in
  one write call (`say`); `print` writes a line and its newline in two when stderr is unbuffered
  (PYTHONUNBUFFERED, `python -u`), and another rank's line can land between them.
- Fault injection: the "key=value,key=value" requests tests put in environment variables
  (FLASHFLEX_FAULT_INJECT, FLASHFLEX_DELAY_INJECT: runtime/training/worker.py; FLASHFLEX_OOM_INJECT:
  runtime/device/oom_injection.py; FLASHFLEX_OVERFLOW_INJECT: runtime/training/loss_scale.py), parsed strictly by
  `parse_injection`: every bad field is one InputError naming the variable and the field.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import InputError

JOB_DIR_ENV = "FLASHFLEX_JOB_DIR"
LAUNCHER_PID_ENV = "FLASHFLEX_LAUNCHER_PID"
INTERVAL_ENV = "FLASHFLEX_HEARTBEAT_S"
MIN_SILENCE_S = 5.0  # a worker's first `import torch` may hold the interpreter lock for a second or two

PEER_LOST = 3  # the exit code of a rank that stopped because a peer failed
OOM_LINE_PREFIX = "out of memory"  # every out-of-memory line of a rank starts with it


def say(line: str) -> None:
    """Write `line` and its newline to stderr in one write call, so that lines of processes sharing that stderr
    never interleave (a pipe's writes up to PIPE_BUF, 4096 bytes on Linux, are atomic)."""
    sys.stderr.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


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


def is_oom_line(text: str | None) -> bool:
    """Whether a rank's one-line error is an out-of-memory report (runtime/device/oom.py's `oom_line`)."""
    return bool(text) and text.startswith(OOM_LINE_PREFIX)  # type: ignore[union-attr]


def parse_injection(env_name: str, text: str, keys: Sequence[str], required: Sequence[str],
                    choices: Mapping[str, Sequence[str]] | None = None) -> dict[str, int | str]:
    """The fields of `text` (comma-separated key=value), each key one of `keys`: a whole number >= 0, or for a key
    of `choices` one of its values (a string). Every key of `required` must be given."""
    choices = choices or {}
    fields: dict[str, int | str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in keys:
            raise InputError(f"{env_name}: {part!r} is not one of {', '.join(k + '=' for k in keys)}")
        if key in choices:
            if value not in choices[key]:
                raise InputError(f"{env_name}: {key} {value!r} is not one of {', '.join(choices[key])}")
            fields[key] = value
            continue
        try:
            number = int(value)
        except ValueError:
            raise InputError(f"{env_name}: {key}={value!r} is not a whole number") from None
        if number < 0:
            raise InputError(f"{env_name}: {key}={value!r} is negative")
        fields[key] = number
    if any(key not in fields for key in required):
        raise InputError(f"{env_name}: {' and '.join(k + '=' for k in required)} are required, got {text!r}")
    return fields

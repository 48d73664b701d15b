"""Turn the ranks' exits into one line naming the plan rank, its node and device; say what a stop left behind.

Several ranks usually fail together: the one that crashed, then its peers whose collectives broke
(they exit with `runtime.worker.PEER_LOST`). The root cause is, in this order: a rank that ran out of memory
(its one line, runtime/oom.py, names it), a rank the launcher found frozen (no heartbeat), a signal the job
does not send itself, an error of its own, a rank the launcher stopped, a rank that lost a peer; the earliest
among equals. An out-of-memory's line names its rank, device and stage itself and is reported as it is. A failure record has the fields of torch
elastic's ProcessFailure that matter here (local_rank, exitcode, timestamp), and optionally `reason` (the
rank's own one-line error), `silent` (frozen) and `stopped` (killed by the launcher while ending the job).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

from ..errors import FlashflexError, RuntimeFailure
from ..plan.schema import Plan
from ..runtime.oom import is_oom_line

_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)}
PEER_LOST = 3  # keep equal to runtime.worker.PEER_LOST (the launcher does not import the runtime)

CheckpointStamp = tuple[str, int]  # a checkpoint folder and its manifest's modification time (ns)


class Interrupted(FlashflexError):
    """The launch was stopped by a signal (SIGTERM, SIGINT); exit code 128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def exit_text(exitcode: int) -> str:
    """"exit code N" or "killed by signal N (SIGNAME)"."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-exitcode} ({name})"
    if exitcode == PEER_LOST:
        return f"exit code {exitcode} (a peer rank failed)"
    return f"exit code {exitcode}"


def _kind(failure: Any) -> int:
    """Rank of a failure as a root cause (lower: more likely to have started it)."""
    code = int(failure.exitcode)
    if is_oom_line(getattr(failure, "reason", None)):
        return -2  # out of memory: its peers' broken collectives and timeouts follow from it
    if getattr(failure, "silent", False):
        return -1  # frozen: stopped sending heartbeats
    if getattr(failure, "stopped", False) or code - 128 in _STOP_SIGNALS:
        return 2  # killed by the launcher while it ended the job, or left quietly on its stop signal
    if code < 0 and -code not in _STOP_SIGNALS:
        return 0  # killed by a signal nobody in the job sends (SIGKILL by the OOM killer, SIGSEGV, ...)
    if code > 0 and code != PEER_LOST:
        return 1  # an error of its own
    if code < 0:
        return 2  # stopped by the launcher's shutdown of the others
    return 3  # lost a peer


def root_cause(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The (local rank, failure record) most likely to have started the failure."""
    return min(sorted(failures.items()),
               key=lambda item: (_kind(item[1]), float(getattr(item[1], "timestamp", 0)), item[0]))


def describe_failure(plan: Plan, node: str | None, failures: Mapping[int, Any]) -> RuntimeFailure:
    """A RuntimeFailure for a failed launch on one host (`node` None: all plan nodes ran here)."""
    _, failure = root_cause(failures)
    ranks = [info for info in plan.ranks() if node is None or info.device.rpartition("/")[0] == node]
    local = int(failure.local_rank)
    others = len(failures) - 1
    if local < len(ranks):
        info = ranks[local]
        who = f"rank {info.rank} (node {info.device.rpartition('/')[0]}, device {info.device})"
    else:
        who = f"local rank {local}"
    what = getattr(failure, "reason", None) or exit_text(int(failure.exitcode))
    more = f"; {others} other rank(s) stopped after it" if others else ""
    if is_oom_line(what):  # it names the rank, its device and stage itself
        return RuntimeFailure(f"{what}{more}; the job was stopped")
    return RuntimeFailure(f"{who} failed: {what}{more}; the job was stopped")


def stop_text(sig: signal.Signals) -> str:
    """How a stop by `sig` is told: "interrupted" (Ctrl-C) or "stopped by SIGNAME"."""
    return "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"


def checkpoint_stamp(checkpoint_dir: str | None) -> CheckpointStamp | None:
    """The newest complete checkpoint under `checkpoint_dir` and its manifest's mtime (None: none), taken before
    a launch to tell a checkpoint it writes from one that was there already."""
    if checkpoint_dir is None or not os.path.isdir(checkpoint_dir):
        return None
    from ..semantics.run_folder import MANIFEST, latest_checkpoint

    found = latest_checkpoint(checkpoint_dir)
    if found is None:
        return None
    try:
        return str(found), os.stat(found / MANIFEST).st_mtime_ns
    except OSError:
        return None


def checkpoint_note(checkpoint_dir: str | None, before: CheckpointStamp | None) -> str:
    """What a stopped launch left: "checkpoint written at step N (FOLDER)" when the checkpoint folder holds a
    complete checkpoint that was not there before the launch, else why none was written."""
    if checkpoint_dir is None:
        return "no checkpoint was written (--no-checkpoint)"
    now = checkpoint_stamp(checkpoint_dir)
    if now is None or now == before:
        return "no checkpoint was written (interrupted before a step boundary)"
    from ..semantics.run_folder import read_manifest

    try:
        step = read_manifest(now[0])["step"]
    except FlashflexError:
        return f"checkpoint folder {now[0]} was written but its manifest is unreadable"
    return (f"checkpoint written at step {step} ({now[0]}); the same command continues from it (--resume under "
            "another plan or settings)")

"""Turn torch elastic's failure report into one line naming the plan rank, its node and device.

Several ranks usually fail together: the one that crashed, then its peers whose collectives broke
(they exit with `runtime.worker.PEER_LOST`). The root cause is a failure that is not PEER_LOST (a
signal the job does not send itself first, then an error of its own, then ranks the launcher stopped,
then ranks that lost a peer), the earliest among equals.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

from ..errors import FlashflexError, RuntimeFailure
from ..plan.schema import Plan

_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)}
PEER_LOST = 3  # keep equal to runtime.worker.PEER_LOST (the launcher does not import the runtime)


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


def root_cause(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The (torchrun rank, ProcessFailure) most likely to have started the failure."""
    items = sorted(failures.items())

    def order(item: tuple[int, Any]) -> tuple[int, int, int]:
        code = int(item[1].exitcode)
        if code < 0 and -code not in _STOP_SIGNALS:
            kind = 0  # killed by a signal nobody in the job sends (SIGKILL by the OOM killer, SIGSEGV, ...)
        elif code > 0 and code != PEER_LOST:
            kind = 1  # an error of its own
        elif code < 0:
            kind = 2  # stopped by the agent's shutdown of the others
        else:
            kind = 3  # lost a peer
        return kind, int(getattr(item[1], "timestamp", 0)), item[0]

    return min(items, key=order)


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
    more = f"; {others} other rank(s) stopped after it" if others else ""
    return RuntimeFailure(f"{who} failed: {exit_text(int(failure.exitcode))}{more}; the job was stopped")

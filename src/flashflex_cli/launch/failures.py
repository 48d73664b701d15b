"""Turn the ranks' exits into one line naming the plan rank, its node and device; say what a stop left behind.

Several ranks usually fail together: the one that crashed, then its peers whose collectives broke
(they exit with `semantics/worker_protocol.PEER_LOST`). The root cause is, in this order: a rank that ran out of memory
(its one line, runtime/device/oom.py, names it), a rank the launcher found frozen (no heartbeat), a signal the job
does not send itself, an error of its own, a rank the launcher stopped, a rank that lost a peer; the earliest
among equals. An out-of-memory's line names its rank, device and stage itself and is reported as it is. A failure record has the fields of torch
elastic's ProcessFailure that matter here (local_rank, exitcode, timestamp), and optionally `reason` (the
rank's own one-line error), `silent` (frozen) and `stopped` (killed by the launcher while ending the job).

On GPU plans (`nccl=True`) a rank that ended by SIGABRT (exit -6, or 134 where a shell reports it) was, all but
always, ended by ProcessGroupNCCL's watchdog: a collective outlived its timeout while the rank waited for a peer
(NCCL raises no Python exception, so the worker's "lost a peer" path never ran). Such a rank counts as one that
lost a peer, not as the cause: the rank that failed on its own, froze, or never came to the collective (and was
stopped by the launcher) is named, with the count of ranks the watchdog aborted and where the flight recorder's
dumps are (semantics/flight_recorder.py). When every failed rank was aborted so, none is blamed: the line says so
and points at the dumps, which tell which collective each rank waited in.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from typing import Any

from ..errors import FlashflexError, RuntimeFailure
from ..hardware.cluster import Cluster
from ..plan.schema import Plan
from ..semantics import flight_recorder
from ..semantics.worker_protocol import PEER_LOST, is_oom_line

_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)}
CPU_TYPES = ("cpu", "host")  # emulated CPU devices (gloo); every other device type is a GPU (NCCL)

CheckpointStamp = tuple[str, int]  # a checkpoint folder and its manifest's modification time (ns)


class Interrupted(FlashflexError):
    """The launch was stopped by a signal (SIGTERM, SIGINT); exit code 128 + the signal number."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


SIGABRT_EXITS = (-int(signal.SIGABRT), 128 + int(signal.SIGABRT))  # as torch elastic, as a shell reports it
WATCHDOG_TEXT = "aborted by the NCCL watchdog waiting for a peer (SIGABRT)"


def watchdog_abort(failure: Any, nccl: bool) -> bool:
    """True for a rank of a GPU plan that ended by SIGABRT with no error of its own (module docstring)."""
    return nccl and int(failure.exitcode) in SIGABRT_EXITS and not getattr(failure, "reason", None) \
        and not getattr(failure, "silent", False)


def exit_text(exitcode: int, nccl: bool = False) -> str:
    """"exit code N" or "killed by signal N (SIGNAME)"; on a GPU plan (`nccl`) a SIGABRT is the NCCL watchdog's."""
    if nccl and exitcode in SIGABRT_EXITS:
        return WATCHDOG_TEXT
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-exitcode} ({name})"
    if exitcode == PEER_LOST:
        return f"exit code {exitcode} (a peer rank failed)"
    return f"exit code {exitcode}"


def _kind(failure: Any, nccl: bool = False) -> int:
    """Rank of a failure as a root cause (lower: more likely to have started it)."""
    code = int(failure.exitcode)
    if watchdog_abort(failure, nccl):
        return 3  # waited for a peer until NCCL's watchdog ended it
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


def root_cause(failures: Mapping[int, Any], nccl: bool = False) -> tuple[int, Any]:
    """The (local rank, failure record) most likely to have started the failure (`nccl`: a GPU plan)."""
    return min(sorted(failures.items()),
               key=lambda item: (_kind(item[1], nccl), float(getattr(item[1], "timestamp", 0)), item[0]))


def _who(ranks: list[Any], local: int) -> str:
    if local < len(ranks):
        info = ranks[local]
        return f"rank {info.rank} (node {info.device.rpartition('/')[0]}, device {info.device})"
    return f"local rank {local}"


def describe_failure(plan: Plan, node: str | None, failures: Mapping[int, Any], nccl: bool = False,
                     trace_prefix: str | None = None) -> RuntimeFailure:
    """A RuntimeFailure for a failed launch on one host (`node` None: all plan nodes ran here). `nccl`: the plan
    runs on GPUs (a SIGABRT is the watchdog's); `trace_prefix`: where the flight recorder's dumps go."""
    _, failure = root_cause(failures, nccl)
    ranks = [info for info in plan.ranks() if node is None or info.device.rpartition("/")[0] == node]
    aborted = sorted(local for local, f in failures.items() if watchdog_abort(f, nccl))
    dumps = f" (flight recorder dumps: {trace_prefix}N)" if trace_prefix else ""
    if aborted and len(aborted) == len(failures):
        names = ", ".join(_who(ranks, int(failures[local].local_rank)) for local in aborted)
        return RuntimeFailure(f"{names}: {WATCHDOG_TEXT}; none reported an error of its own: which collective each "
                              f"waited in tells the peer that never came{dumps}; the job was stopped")
    others = len(failures) - 1
    what = getattr(failure, "reason", None) or exit_text(int(failure.exitcode), nccl)
    if aborted and getattr(failure, "stopped", False):
        what = ("still running when the NCCL watchdog aborted its peers (it had not joined the collective they "
                "waited in); stopped by the launcher")
    if aborted:
        more = f"; {len(aborted)} rank(s) {WATCHDOG_TEXT.removesuffix(' (SIGABRT)')}{dumps}"
        if others > len(aborted):
            more += f", {others - len(aborted)} other rank(s) stopped after it"
    else:
        more = f"; {others} other rank(s) stopped after it" if others else ""
    if is_oom_line(what):  # it names the rank, its device and stage itself
        return RuntimeFailure(f"{what}{more}; the job was stopped")
    return RuntimeFailure(f"{_who(ranks, int(failure.local_rank))} failed: {what}{more}; the job was stopped")


def describe_local_failure(plan: Plan, cluster: Cluster, failures: Mapping[int, Any],
                           run_dir: str) -> RuntimeFailure:
    """`describe_failure` for a local launch of `plan` on `cluster` with run folder `run_dir`: on GPU plans a
    SIGABRT is the NCCL watchdog's, its dumps where the workers' environment puts them."""
    nccl = any(cluster.device(info.device).type.lower() not in CPU_TYPES for info in plan.ranks())
    prefix = flight_recorder.prefix_in_effect(run_dir, os.environ) if nccl else None
    return describe_failure(plan, None, failures, nccl=nccl, trace_prefix=prefix)


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

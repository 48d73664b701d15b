"""Two collective timeouts for one run: a long one while the ranks may legitimately wait on each other for long,
the run's own (`--timeout`) for the steps.

Long (RunConfig.setup_seconds: `--setup-timeout`, default max(--timeout, 600 s)): joining the process group and
creating the plan's groups, building the stage (initial weights, a Hugging Face checkpoint), the compile
warm-up and its failure agreement, loading a checkpoint, the first step (lazy initialisation, the allocator's
first growth, NCCL's first connections), and every checkpoint save (all ranks wait in its barriers while
pipeline 0's ranks write the whole state). The run's timeout then bounds how long survivors of a dead or stuck
rank wait in any other step. torchtitan does the same (a long timeout for initialisation and the first step,
then the training one).

Why it matters more on NCCL than on gloo: at a timeout NCCL's watchdog ends the process with SIGABRT, no Python
exception (see launch/failures.py for how the launcher reads that); gloo raises in the waiting rank.

The timeout of an existing group is changed with torch.distributed's `_set_pg_timeout` (a private function in
torch 2.x, also used by torchtitan); it applies to collectives issued after the change. Where a torch version
lacks it, the long timeout stays for the whole run (never a too-short one), and `settable()` says so. Gloo's
point-to-point sends and receives keep the timeout their group had when it was made, so on CPU devices the
pipeline waits for them with the current timeout given explicitly (`PlanGroups.p2p_wait`); on NCCL a timeout
given to `wait()` would block the host, and its point-to-point operations follow the group's timeout anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from .groups import PlanGroups


def settable() -> bool:
    """Whether this torch can change an existing process group's timeout."""
    return callable(getattr(dist.distributed_c10d, "_set_pg_timeout", None))


def set_timeouts(groups: Iterable[dist.ProcessGroup | None], seconds: float) -> bool:
    """Give every group (None: the default group) the collective timeout `seconds`; False where torch cannot."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if not callable(setter):
        return False
    for group in groups:
        setter(timedelta(seconds=seconds), group)
    return True


class PhasedTimeouts:
    """The run's two timeouts over this rank's groups (the default group and those of `groups` it belongs to).
    Starts long: create the groups with `setup_s`; call `settle()` once the first step is done, wrap checkpoint
    saves in `long()`. `on_cpu`: gloo groups (their point-to-point waits get the timeout explicitly)."""

    def __init__(self, groups: PlanGroups, setup_s: float, run_s: float, on_cpu: bool) -> None:
        self.plan_groups, self.on_cpu = groups, on_cpu
        self.groups: list[dist.ProcessGroup | None] = [None, *groups.member_groups()]
        self.setup_s, self.run_s = setup_s, run_s
        self.current_s = setup_s
        self._apply(setup_s)

    def _apply(self, seconds: float) -> bool:
        if not set_timeouts(self.groups, seconds):
            return False
        if self.on_cpu:
            self.plan_groups.p2p_wait = timedelta(seconds=seconds)
        return True

    def settle(self) -> None:
        """From now on the run's timeout (after the first step)."""
        if self._apply(self.run_s):
            self.current_s = self.run_s

    @contextmanager
    def long(self) -> Iterator[None]:
        """The long timeout inside the block (a checkpoint save), the current one again after it."""
        if self.current_s == self.setup_s:
            yield
            return
        self._apply(self.setup_s)
        try:
            yield
        finally:
            self._apply(self.current_s)

"""Two collective timeouts (runtime/parallel/timeouts.py): the long one of set-up, the first step and checkpoint saves,
then the run's `--timeout`; checked on gloo, where a timeout raises in the waiting rank.

The sleeps only have to lie on the right side of the timeouts, by a wide margin (a 1 s or 2 s timeout against
3 s to 6 s of waiting, the long timeout at 60 s or more); no duration is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashflex_cli.runtime.parallel.timeouts import PhasedTimeouts, settable
from flashflex_cli.runtime.training.worker import injected_delay
from tests.conftest import FLASHFLEX
from tests.infra.worker_pool import WorkerPool, gloo_rank

from .test_faults import CLUSTER, plan2  # noqa: F401

SHORT_S, LONG_S, WAIT_S = 1.0, 60.0, 3.0


def _sum(group: dist.ProcessGroup) -> str:
    """All-reduce one number; "ok" or the error's first line."""
    try:
        dist.all_reduce(torch.ones(1), group=group)
        return "ok"
    except RuntimeError as exc:
        return str(exc).splitlines()[0] or type(exc).__name__


class _Groups:
    """The one method of PlanGroups that PhasedTimeouts reads, over one group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.p2p_wait = group, None

    def member_groups(self) -> list[dist.ProcessGroup]:
        return [self.group]


def phases_job(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Rank 1 makes rank 0 wait WAIT_S in three phases: before settle(), inside long() after it, and after it;
    each rank records what its collective did."""
    with gloo_rank(rank, world, init_file):
        group = dist.new_group([0, 1], timeout=timedelta(seconds=LONG_S))
        timeouts = PhasedTimeouts(_Groups(group), LONG_S, SHORT_S, on_cpu=True)
        seen = []
        for phase in ("setup", "checkpoint", "step"):
            if rank == 1:
                time.sleep(WAIT_S)
            if phase == "checkpoint":
                with timeouts.long():
                    seen.append(_sum(group))
            else:
                seen.append(_sum(group))
            if phase == "setup":
                timeouts.settle()
        torch.save({"seen": seen, "current": timeouts.current_s}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(2, phases_job) as workers:
        yield workers


@pytest.mark.slow
@pytest.mark.skipif(not settable(), reason="this torch cannot change a process group's timeout")
def test_the_long_timeout_covers_setup_and_saves_then_the_short_one_applies(tmp_path: Path,
                                                                           pool: WorkerPool) -> None:
    pool.run([(rank, 2, str(tmp_path / "store"), str(tmp_path)) for rank in range(2)], 120.0)
    waited = torch.load(tmp_path / "rank0.pt")
    assert waited["current"] == SHORT_S
    assert waited["seen"][:2] == ["ok", "ok"], waited  # a 3 s wait within the 60 s timeout, twice
    assert waited["seen"][2] != "ok" and "imed out" in waited["seen"][2], waited  # the 1 s timeout, after settle()


def test_delay_injection_is_parsed_per_rank_and_step() -> None:
    env = {"FLASHFLEX_DELAY_INJECT": "rank=1,seconds=4; rank=0,seconds=2,step=0;rank=0,seconds=3,step=0"}
    assert injected_delay(env, 1, None) == 4.0
    assert injected_delay(env, 0, 0) == 5.0
    assert injected_delay(env, 0, None) == 0.0 and injected_delay(env, 1, 0) == 0.0
    assert injected_delay({}, 0, None) == 0.0


def _launch(plan: Path, out: Path, delay: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FLASHFLEX, "launch", str(plan), "--cluster", CLUSTER, "--out", str(out), "--steps", "3",
                           "--timeout", "2", *extra], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FLASHFLEX_DELAY_INJECT": delay})


@pytest.mark.slow
def test_a_slow_setup_and_first_step_do_not_end_the_run_a_slow_later_step_does(
        plan2: Path, tmp_path: Path) -> None:  # noqa: F811
    """--timeout 2: rank 1 waits 5 s in its set-up and rank 0 5 s at the start of step 0, under the long timeout:
    the run completes; rank 1 waiting 8 s at step 2, after the first step, ends it (the peer's collective timed
    out)."""
    slow = _launch(plan2, tmp_path / "slow-setup", "rank=1,seconds=5;rank=0,seconds=5,step=0")
    assert slow.returncode == 0, slow.stderr
    rows = (tmp_path / "slow-setup" / "metrics.jsonl").read_text().splitlines()
    assert len([json.loads(row) for row in rows]) == 3
    late = _launch(plan2, tmp_path / "slow-step", "rank=1,seconds=8,step=2")
    assert late.returncode == 1, late.stderr
    assert "failed" in late.stderr.strip().splitlines()[-1]
    assert len((tmp_path / "slow-step" / "metrics.jsonl").read_text().splitlines()) == 2

"""Spawned worker processes reused across multi-process test runs, and across the test session.

Each job builds and tears down its own process group, so the suite pays the interpreter and torch start-up once
per process, not once per plan and rank, nor once per test: every `WorkerPool` of the session runs its jobs on
one shared set of processes (`_SHARED`), spawned when first needed, grown to the largest pool asked for, and
closed when the session's interpreter exits. A job is a tuple of arguments for `job_fn` (a module-level function,
so spawn can pickle it by reference) whose first element is the rank. Each job runs under the test process's
environment variables of the moment it is sent, as a process spawned then would, and from a fresh interpreter's
state where an earlier job can change it: torch's default random seed, TorchDynamo's compiled code and counters
(`gloo_rank` sets determinism and the thread count for every job); the garbage of each job is collected after
it (process groups in reference cycles keep their gloo threads running).
After a failed job the processes are replaced, since survivors may be stuck in a collective.
"""

from __future__ import annotations

import atexit
import gc
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Job = tuple[Any, ...]


@contextmanager
def gloo_rank(rank: int, world: int, init_file: str, deterministic: bool = True) -> Iterator[None]:
    """Be `rank` of a `world`-rank gloo group joined through the file `init_file` (120 s collective timeout),
    with one intra-op thread and, by default, deterministic algorithms; the group is destroyed on exit."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(deterministic)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _serve(inbox: Any, outbox: Any) -> None:
    """A reusable worker process: runs `job_fn(*job)` for each (job_fn, job, environment) from `inbox` until None,
    each under the test process's environment of the moment and from a fresh interpreter's random seed and compiler
    state; reports (rank, error or None) to `outbox`."""
    seed = torch.initial_seed()
    while (message := inbox.get()) is not None:
        job_fn, job, environ = message
        torch.manual_seed(seed)
        os.environ.clear()
        os.environ.update(environ)
        if "torch._dynamo" in sys.modules:  # imported by an earlier job
            sys.modules["torch._dynamo"].reset()
        try:
            job_fn(*job)
            error = None
        except BaseException:  # noqa: BLE001 - report every failure to the test process
            error = traceback.format_exc()
        gc.collect()  # the job's process groups (and their gloo threads) may sit in reference cycles
        outbox.put((job[0], error))
    # Every result was received by the test process before it sent None: skip the slow interpreter teardown.
    os._exit(0)


class _Processes:
    """The session's worker processes: one inbox each, one shared outbox."""

    def __init__(self) -> None:
        self.inboxes: list[Any] = []
        self.procs: list[Any] = []
        self.outbox: Any = None

    def at_least(self, size: int) -> None:
        """Spawn processes until there are `size`."""
        ctx = mp.get_context("spawn")
        if self.outbox is None:
            self.outbox = ctx.Queue()
        while len(self.procs) < size:
            inbox = ctx.Queue()
            proc = ctx.Process(target=_serve, args=(inbox, self.outbox), daemon=True)
            proc.start()
            self.inboxes.append(inbox)
            self.procs.append(proc)

    def close(self) -> None:
        """Stop every process (politely, then by force)."""
        for q in self.inboxes:
            q.put(None)
        self._reap(timeout_s=10)

    def kill(self) -> None:
        """Stop every process at once (after a failure: some may be stuck in a collective)."""
        for proc in self.procs:
            proc.kill()
        self._reap(timeout_s=None)

    def _reap(self, timeout_s: float | None) -> None:
        for proc in self.procs:
            proc.join(timeout=timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.inboxes, self.procs, self.outbox = [], [], None


_SHARED = _Processes()
atexit.register(_SHARED.close)


class WorkerPool:
    """`size` of the session's worker processes running `job_fn` jobs; a context manager (the processes outlive
    it, for the next pool)."""

    def __init__(self, size: int, job_fn: Callable[..., None]) -> None:
        self.size, self.job_fn = size, job_fn
        _SHARED.at_least(size)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def run(self, jobs: list[Job], timeout_s: float = 300.0) -> None:
        """Run one job per rank (job[0] is the rank) concurrently; raise with the first failure."""
        assert len(jobs) <= self.size
        _SHARED.at_least(self.size)  # (again, after a failure replaced them)
        for rank, job in enumerate(jobs):
            _SHARED.inboxes[rank].put((self.job_fn, job, dict(os.environ)))
        deadline = time.monotonic() + timeout_s
        errors: list[str] = []
        for _ in jobs:
            try:
                rank, error = _SHARED.outbox.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                errors.append(f"timed out after {timeout_s} s")
                break
            if error is not None:
                errors.append(f"rank {rank}: {error}")
                break
        if errors:
            _SHARED.kill()
            raise AssertionError("\n".join(errors))

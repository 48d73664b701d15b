"""Spawned worker processes reused across multi-process test runs.

Each job builds and tears down its own process group, so the suite pays the interpreter and torch start-up once
per process, not once per plan and rank. A job is a tuple of arguments for `job_fn` (a module-level function,
so spawn can pickle it by reference) whose first element is the rank. After a failed job the processes are
replaced, since survivors may be stuck in a collective.
"""

from __future__ import annotations

import os
import queue
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
    if deterministic:
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _serve(job_fn: Callable[..., None], inbox: Any, outbox: Any) -> None:
    """A reusable worker process: runs `job_fn(*job)` for each job from `inbox` until None; reports (rank, error
    or None) to `outbox`."""
    while (job := inbox.get()) is not None:
        try:
            job_fn(*job)
            outbox.put((job[0], None))
        except BaseException:  # noqa: BLE001 - report every failure to the test process
            outbox.put((job[0], traceback.format_exc()))
    # Every result was received by the test process before it sent None: skip the slow interpreter teardown.
    os._exit(0)


class WorkerPool:
    """`size` spawned processes running `job_fn` jobs; a context manager that closes them."""

    def __init__(self, size: int, job_fn: Callable[..., None]) -> None:
        self.size, self.job_fn = size, job_fn
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in range(self.size)]
        self.outbox = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(self.job_fn, q, self.outbox), daemon=True)
                      for q in self.inboxes]
        for proc in self.procs:
            proc.start()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process (politely, then by force)."""
        for q in self.inboxes:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def run(self, jobs: list[Job], timeout_s: float = 300.0) -> None:
        """Run one job per rank (job[0] is the rank) concurrently; raise with the first failure."""
        assert len(jobs) <= self.size
        for rank, job in enumerate(jobs):
            self.inboxes[rank].put(job)
        deadline = time.monotonic() + timeout_s
        errors: list[str] = []
        for _ in jobs:
            try:
                rank, error = self.outbox.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                errors.append(f"timed out after {timeout_s} s")
                break
            if error is not None:
                errors.append(f"rank {rank}: {error}")
                break
        if errors:
            for proc in self.procs:
                proc.kill()
                proc.join()
            self._start()
            raise AssertionError("\n".join(errors))

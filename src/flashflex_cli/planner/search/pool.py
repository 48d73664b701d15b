"""Independent units of the search (a pipeline count, a candidate to refine) run in worker processes.

`SearchPool.map(fn, items)` returns `[fn(cache, item) for item in items]` in the order of `items`, whatever
the number of workers, so the search merges results exactly as the single-process search does and the plan
is byte-identical with 1 or N workers (every unit is a pure function of the cache's inputs and its item:
the memo tables only avoid recomputing equal answers).

Workers are forked (Linux): they inherit the parent's `CostCache`, memo tables included, without pickling
it; only items and results cross the process boundary. Fork is used only while the parent runs a single
thread (forking a process with other threads can leave their locks held in the child; the planner starts
none, and torch is not imported on the planning path); otherwise, with one job, or where fork is not
available, the units run in the calling process. The CPU seconds of the workers are theirs, not the
parent's: measure them with `resource.getrusage(RUSAGE_CHILDREN)` after the pool is closed.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from ..scoring.cost_cache import CostCache

T = TypeVar("T")
R = TypeVar("R")

# The worker's CostCache, set once by the initializer in each forked worker process (never in the parent).
_WORKER: dict[str, CostCache] = {}


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _init(cache: CostCache) -> None:
    _WORKER["cache"] = cache


def _call(job: tuple[Callable[[CostCache, Any], Any], Any]) -> Any:
    fn, item = job
    return fn(_WORKER["cache"], item)


class SearchPool:
    """Maps units of search work over `jobs` forked workers (or in-process, see module docstring)."""

    def __init__(self, cache: CostCache, jobs: int = 1) -> None:
        self.cache = cache
        self.jobs = max(1, int(jobs))
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor | None:
        if self._executor is None and self.jobs > 1 and threading.active_count() == 1 \
                and "fork" in multiprocessing.get_all_start_methods():
            self._executor = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("fork"),
                                                 initializer=_init, initargs=(self.cache,))
        return self._executor

    def map(self, fn: Callable[[CostCache, T], R], items: Iterable[T]) -> list[R]:
        """`[fn(cache, item) for item in items]`, in order; `fn` must be a module-level function."""
        items = list(items)
        pool = self._pool() if len(items) > 1 else None
        if pool is None:
            return [fn(self.cache, item) for item in items]
        try:
            # contiguous chunks: neighbouring units (pipeline counts) share most memo entries
            chunk = -(-len(items) // (2 * self.jobs))
            return list(pool.map(_call, [(fn, item) for item in items], chunksize=chunk))
        except BrokenProcessPool:  # a worker died (killed, out of memory): do the units here instead
            self.close()
            self.jobs = 1
            return [fn(self.cache, item) for item in items]

    def close(self) -> None:
        """Stop the workers (waits for them, so their CPU time is counted in RUSAGE_CHILDREN)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> SearchPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


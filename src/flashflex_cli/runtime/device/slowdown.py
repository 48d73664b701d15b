"""Emulated slow devices: after each compute op of a stage, sleep so that the op takes `slowdown` times its
compute time, so a device with slowdown 2 runs its compute half as fast. Communication is not slowed: time spent
in tensor-parallel collectives inside the op (read from `comm_clock`, seconds) is not counted as compute.

Time the op's thread spent runnable but waiting for a host core (run-queue delay, from Linux
/proc/thread-self/schedstat; 0 where unavailable) is host contention, not device compute: it is neither
stretched by the slowdown nor added on top of it, but absorbed by the sleep. Otherwise, with more emulated
devices than host cores, ranks whose compute bursts coincide (neighbouring pipeline stages released by the same
exchange) would see their contention multiplied by their slowdown."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ...errors import InputError

_SCHEDSTAT = "/proc/thread-self/schedstat"


def runqueue_seconds() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (0.0 where not available)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, IndexError, ValueError):
        return 0.0


class Slowdown:
    """Stretch compute by a factor >= 1. `slept` accumulates the added seconds. `comm_clock()` returns the
    running total of communication seconds to leave out (e.g. TPContext.comm_seconds). `clock`, `sleep` and
    `queue_clock` (seconds) default to time.perf_counter, time.sleep and `runqueue_seconds`."""

    def __init__(self, factor: float = 1.0, comm_clock: Callable[[], float] | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                 queue_clock: Callable[[], float] | None = None) -> None:
        if not factor >= 1.0:
            raise InputError(f"slowdown must be >= 1, got {factor}")
        self.factor = factor
        self.comm_clock = comm_clock or (lambda: 0.0)
        self.clock, self.sleep = clock, sleep
        self.queue_clock = queue_clock or runqueue_seconds
        self.slept = 0.0

    @contextmanager
    def op(self) -> Iterator[None]:
        """Time the enclosed compute (less communication and run-queue delay) and then sleep so the op lasts
        `factor` times that compute: (factor - 1) x compute, less the run-queue delay already spent."""
        if self.factor <= 1.0:
            yield
            return
        start, comm, queued = self.clock(), self.comm_clock(), self.queue_clock()
        yield
        waited = self.queue_clock() - queued
        compute = (self.clock() - start) - (self.comm_clock() - comm) - waited
        extra = max(0.0, (self.factor - 1.0) * max(0.0, compute) - waited)
        self.sleep(extra)
        self.slept += extra

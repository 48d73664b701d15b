"""Emulated slow devices: after each compute op of a stage, sleep (slowdown - 1) x its measured duration, so a
device with slowdown 2 runs its compute half as fast. Communication is not slowed: time spent in tensor-parallel
collectives inside the op (read from `comm_clock`, seconds) is not counted as compute."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import InputError


class Slowdown:
    """Stretch compute by a factor >= 1. `slept` accumulates the added seconds. `comm_clock()` returns the
    running total of communication seconds to leave out (e.g. TPContext.comm_seconds)."""

    def __init__(self, factor: float = 1.0, comm_clock: Callable[[], float] | None = None) -> None:
        if not factor >= 1.0:
            raise InputError(f"slowdown must be >= 1, got {factor}")
        self.factor = factor
        self.comm_clock = comm_clock or (lambda: 0.0)
        self.slept = 0.0

    @contextmanager
    def op(self) -> Iterator[None]:
        """Time the enclosed compute and then sleep (factor - 1) times as long."""
        start, comm = time.perf_counter(), self.comm_clock()
        yield
        if self.factor > 1.0:
            compute = (time.perf_counter() - start) - (self.comm_clock() - comm)
            extra = (self.factor - 1.0) * max(0.0, compute)
            time.sleep(extra)
            self.slept += extra

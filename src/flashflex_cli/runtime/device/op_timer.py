"""Timestamps inside a training step without stalling the device.

On CUDA a mark is an event recorded on the current stream and read only after `finish()` (one synchronize at
the end of the step); on CPU a mark is `time.perf_counter()` at once. Either way `seconds(a, b)` is the time
between two marks, in seconds.
"""

from __future__ import annotations

import time

import torch


class OpTimer:
    """Marks of one step on `device`. Usage: a = t.mark(); ...; b = t.mark(); t.finish(); t.seconds(a, b)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self._marks: list[object] = []
        self._finished = not self.cuda

    def mark(self) -> int:
        """Record a timestamp now (on CUDA: in stream order); returns its handle."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
            self._finished = False
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def finish(self) -> None:
        """Wait until every recorded mark has happened (on CUDA the only synchronize of the step)."""
        if self.cuda and self._marks and not self._finished:
            self._marks[-1].synchronize()  # type: ignore[attr-defined]
        self._finished = True

    def seconds(self, start: int, end: int) -> float:
        """Seconds from mark `start` to mark `end` (call `finish()` first on CUDA)."""
        if not self._finished:
            raise RuntimeError("OpTimer.seconds before finish()")
        a, b = self._marks[start], self._marks[end]
        if self.cuda:
            return a.elapsed_time(b) / 1e3  # type: ignore[attr-defined]
        return float(b) - float(a)  # type: ignore[arg-type]

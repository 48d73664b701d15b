"""The peak of live tensor bytes in a process, with PyTorch's own accounting (torch.distributed._tools.mem_tracker).

MemTracker counts every tensor storage an operation creates (a dispatch mode) and drops it when the storage is
freed (weak references), per device. Its per-module bookkeeping (a ModTracker) refuses a module called twice at
the top level, which a 1F1B schedule does with every micro-batch, and the gradient hooks it puts on every module
input keep a pipeline stage's received activations alive after their backward; `TensorAccounting` keeps the
storage accounting and leaves the module tracking out. `reset_peak()` starts a new peak at the current total, as torch.cuda.reset_peak_memory_stats
does for the caching allocator.
"""

from __future__ import annotations

from typing import Any

from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker


class _NoModuleTracking:
    """Stands in for MemTracker's ModTracker: registers nothing; outside any backward."""

    is_bw = False
    parents: set[str] = set()

    def register_user_hooks(self, *hooks: Any) -> None:
        return None

    def clear_user_hooks(self) -> None:
        return None

    def __enter__(self) -> _NoModuleTracking:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


class TensorAccounting(MemTracker):
    """Live tensor bytes (all devices together) and their peak since `reset_peak`; use as a context manager
    around everything whose tensors should count (the engine built inside it counts its parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = _NoModuleTracking()  # type: ignore[assignment]
        self.peak_bytes = 0

    def live_bytes(self) -> int:
        """Bytes of the tensor storages alive now."""
        return sum(snapshot[_TOTAL_KEY] for snapshot in self._curr_mem_snap.values())

    def _update_peak_stats(self, peak_state: Any) -> None:  # called after every operation
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.live_bytes()

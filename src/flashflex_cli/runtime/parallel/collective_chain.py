"""Chains of dependent asynchronous collectives, issued from the training thread in one fixed order.

A chain is a list of steps; each step issues one collective with `async_op=True` and returns its handle. Step
k + 1 reads what step k produced (the hierarchical reduction: reduce inside a node, all-reduce across the
leaders, broadcast back), so it may only start once step k's result is there. `ChainQueue` issues the chains
strictly one after the other, in the order they were posted, and never blocks the host before `drain()`:

- CUDA (NCCL): every step is issued at once. The first on the caller's current stream (the one that packed the
  bucket: ProcessGroupNCCL makes its own stream wait for the current one at issue), each later one on a side
  stream that first `wait()`s the previous handle. On NCCL `Work.wait()` blocks no thread: it makes the
  *current CUDA stream* wait for the collective's end event, so the side stream, not the compute stream,
  carries the dependency, and backward kernels and pipeline transfers go on meanwhile. `drain()` waits the
  last handle of every chain on the caller's current stream: what runs after it (copying the sums back, the
  optimizer) is ordered after the reduction, and the host still does not wait.
- CPU (gloo): a handle can only be waited on by blocking, so a later step is issued when `advance()` (called
  from the gradient hooks as the backward goes on) finds the previous one complete (`Work.is_completed()`);
  `drain()` blocks on what is left. Gloo runs each process group's collectives on its own threads, so the
  collectives in flight never hold up the training thread's pipeline transfers or TP all-reduces.

Order and deadlock: a chain's first step is issued only once every step of the previous chain has been issued,
so each rank issues its collectives in the order (chain, step). When every rank posts the chains it shares with
others as a subsequence of one global list (runtime/parallel/grad_buckets.py), every process group sees its collectives
in the same order on all its members. A step is held back only until an earlier step completes, and the
earliest incomplete step of the global order has been issued by all its members, so it completes: nothing can
wait in a cycle. (Gloo matches collectives of one group by their order; NCCL needs the same order per
communicator.)

On CPU each step's seconds in flight are recorded, from its issue to its completion (a callback of its future),
for the runtime's DP timings; on CUDA only the order is kept (the device's time is not read back).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

Step = Callable[[], dist.Work]  # issues one collective with async_op=True on this rank; returns its handle


@dataclass
class Chain:
    """Steps issued in order, each after the previous one's result is there. `timed`: indices of the steps
    whose seconds in flight also count in `ChainQueue.timed_seconds` (the cross-node step of a reduction)."""

    steps: list[Step]
    timed: frozenset[int] = frozenset()
    issued: int = 0  # steps issued so far
    work: dist.Work | None = None  # the handle of the last step issued


def _union_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals [a, b] (seconds)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _stamp_end(span: list[float]) -> None:
    """A future's callback (on the backend's thread): the step in `span` completed now."""
    span[1] = time.perf_counter()


class ChainQueue:
    """The chains of one step of this rank, issued in post order (module docstring). `device`: where the
    tensors live (CUDA: chained on streams; otherwise by polling)."""

    def __init__(self, device: torch.device) -> None:
        self._on_cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device) if self._on_cuda else None
        self._pending: deque[Chain] = deque()  # posted, some steps not yet issued (the first one: the head)
        self._issued: list[Chain] = []  # every step issued, the last one not yet waited on
        self._spans: list[tuple[list[float], bool]] = []  # every CPU step's [issue, completion] and timed flag
        self._unstamped: list[tuple[dist.Work, list[float]]] = []  # CPU steps without a future, not yet seen done

    def post(self, chain: Chain) -> None:
        """Queue `chain` after the chains posted before it and issue what may go now (never blocks)."""
        self._pending.append(chain)
        self.advance()

    def _stamp_completed(self) -> None:
        """Stamp the end of the steps without a future that are complete now (at most this late)."""
        still = []
        for work, span in self._unstamped:
            if work.is_completed():
                _stamp_end(span)
            else:
                still.append((work, span))
        self._unstamped = still

    def advance(self) -> None:
        """Issue every step that may go now, in order (never blocks the host)."""
        self._stamp_completed()
        while self._pending:
            head = self._pending[0]
            if not self._issue_ready(head):
                return
            self._issued.append(self._pending.popleft())

    def drain(self) -> None:
        """Issue every remaining step and wait for every chain: on CPU the host blocks until all are complete;
        on CUDA the caller's current stream waits for them (module docstring)."""
        while self._pending:
            self.advance()
            if self._pending:  # CPU: the head's last issued step is still running
                work = self._pending[0].work
                assert work is not None
                work.wait()
        issued, self._issued = self._issued, []
        for chain in issued:
            if chain.work is not None:
                chain.work.wait()
                self._stamp_completed()
        for _, span in self._unstamped:  # waited for: done by now (a handle keeps its tensors: let them go)
            _stamp_end(span)
        self._unstamped = []

    @property
    def busy(self) -> bool:
        """Some chain posted and not yet waited on by `drain()`."""
        return bool(self._pending or self._issued)

    def seconds(self) -> tuple[float, float]:
        """(seconds some step was in flight, of which some timed step was) since the last `reset_timing()`;
        CPU only (0 on CUDA). Read after `drain()`."""
        spans = [((span[0], span[1]), timed) for span, timed in self._spans]
        return _union_seconds([s for s, _ in spans]), _union_seconds([s for s, timed in spans if timed])

    def reset_timing(self) -> None:
        """Forget the recorded spans (call between steps)."""
        self._spans = []
        self._unstamped = []

    def _issue_ready(self, chain: Chain) -> bool:
        """Issue the steps of `chain` that may go now; True once all are issued."""
        while chain.issued < len(chain.steps):
            if chain.work is not None and not self._on_cuda:
                if not chain.work.is_completed():
                    return False
                chain.work.wait()  # complete: returns at once, or raises the collective's error
            self._issue(chain)
        return True

    def _issue(self, chain: Chain) -> None:
        step = chain.steps[chain.issued]
        if self._on_cuda and chain.work is not None:
            assert self._side is not None
            with torch.cuda.stream(self._side):
                chain.work.wait()  # the side stream waits for the previous step; no thread does
                chain.work = step()
        else:
            start = time.perf_counter()
            chain.work = step()
            if not self._on_cuda:
                span = [start, start]
                self._spans.append((span, chain.issued in chain.timed))
                try:
                    future = chain.work.get_future()
                except RuntimeError:  # gloo's reduce-scatter has none: stamped when seen complete
                    self._unstamped.append((chain.work, span))
                else:
                    future.add_done_callback(lambda _f, span=span: _stamp_end(span))
        chain.issued += 1

"""Gradient sync across unlike pipelines and global-norm clipping.

After backward, every rank holds the gradient of its local shards (replicated parameters such as norm weights
carry the same, full gradient on every rank of a TP group). For each finest common slice held by two or more
stages (`groups.SliceHolders`: one per pipeline, plus the last stage's copy of a tied embedding), the holders
all-reduce (sum) that slice, where one rank per holding stage contributes its gradient and the other ranks of
the same stage contribute zeros, so each stage is counted exactly once whatever its TP degree; the two ends of a
tied embedding thus add their partial gradients. Slices are packed into flat buffers (buckets, see
`grad_buckets`); every rank reduces the buckets it holds in one global order, so the collectives cannot
deadlock.

Two schedules:
- blocking (`overlap=False`): after the whole backward, one bucket per holder set, sorted by holder tuple;
- overlapped (`overlap=True`): one bucket per (layer, holder set). A post-accumulate-grad hook counts each
  parameter's accumulations; after the last micro-batch's (the `num_micro`-th) the parameter is final, and
  every bucket whose parameters are all final is packed at once and handed, strictly in the global order
  (descending layer, embedding last), to one reducer thread per rank that runs the collectives while the
  backward of the lower layers goes on. `finish()` waits for this rank's buckets and copies the sums back.
Either way, with `hierarchical=True` a bucket whose holders span nodes is reduced by `hier_reduce`
(inside each node, across nodes by the leaders, back inside each node); otherwise by one flat all-reduce.

The gradient norm counts every finest slice once (on its `owner` rank) and is summed over the world group.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from ..semantics.parameters import ParamInfo
from .grad_buckets import Bucket, holder_set_buckets, overlap_buckets, rank_buckets
from .groups import PlanGroups, SliceHolders
from .hier_reduce import hier_all_reduce


def _local_view(grad: torch.Tensor, info: ParamInfo, sl: SliceHolders, tp: int, tp_rank: int) -> torch.Tensor:
    """The part of this rank's shard gradient that is slice `sl` of the full tensor (a view)."""
    if sl.dim is None:
        return grad
    start, _ = info.bounds(tp, tp_rank)
    return grad.narrow(sl.dim, sl.start - start, sl.stop - sl.start)


class _Reducer:
    """One daemon thread that runs the submitted calls one after another, in submission order. A daemon, so a
    collective stuck on a failed peer cannot hold the process at exit (a ThreadPoolExecutor's would)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = \
            queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Queue `fn(*args)`; its result (or exception) arrives in the returned future."""
        future: Future[Any] = Future()
        self._jobs.put((future, fn, args))
        return future

    def close(self) -> None:
        """Let the thread end after the calls already queued."""
        self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                    future.set_exception(exc)
            # drop this job's references before waiting for the next: its arguments hold the bucket's flat
            # gradient copy, which would otherwise live on through the whole next step
            del job, future, fn, args


class GradSync:
    """Data-parallel reduction of this rank's shard gradients. `params` maps global name -> (info, parameter);
    `num_micro`: micro-batches per step of this rank's pipeline (accumulations per parameter per step)."""

    def __init__(self, params: dict[str, tuple[ParamInfo, torch.nn.Parameter]], groups: PlanGroups,
                 overlap: bool = False, hierarchical: bool = False, num_micro: int = 1) -> None:
        self.params, self.groups = params, groups
        self.overlap, self.hierarchical, self.num_micro = overlap, hierarchical, num_micro
        mine = [sl for sl in groups.slices if groups.rank in sl.ranks]
        self.buckets = rank_buckets(holder_set_buckets(groups.slices), groups.rank)
        self.layer_buckets = rank_buckets(overlap_buckets(groups.slices), groups.rank)
        self._names = [b.names for b in self.layer_buckets]  # parameters each layer bucket waits for
        self.owned = [sl for sl in mine if sl.owner == groups.rank]
        self.post_log: list[tuple[int, tuple[int, ...]]] = []  # (key, holders) in posting order, last step
        self.busy_s = 0.0  # seconds the reducer spent in collectives during the last step (CPU: wall time)
        self.across_s = 0.0  # of which in hierarchical reductions' cross-node step (leaders only)
        self.posted_in_backward = 0  # buckets of the last step handed over from hooks, before the schedule ended
        self._armed = False
        self._counts: dict[str, int] = {}
        self._final: set[str] = set()
        self._next = 0
        self._posted: list[tuple[Bucket, list[torch.Tensor], torch.Tensor, Future[float]]] = []
        self._pool: _Reducer | None = None
        if overlap and self.layer_buckets:
            watched = set().union(*self._names)
            for name in sorted(watched):
                self.params[name][1].register_post_accumulate_grad_hook(
                    lambda _p, name=name: self._on_accumulated(name))

    def _view(self, sl: SliceHolders) -> torch.Tensor:
        info, param = self.params[sl.name]
        assert param.grad is not None
        return _local_view(param.grad, info, sl, self.groups.tp_size, self.groups.tp_rank)

    def _pack(self, bucket: Bucket) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(views of this rank's slice gradients, flat fp32 copy: the gradients where this rank contributes,
        zeros elsewhere)."""
        views = [self._view(sl) for sl in bucket.slices]
        flat = torch.cat([
            v.reshape(-1) if self.groups.rank in sl.contributors
            else torch.zeros(v.numel(), dtype=v.dtype, device=v.device)
            for v, sl in zip(views, bucket.slices, strict=True)
        ])
        return views, flat

    @staticmethod
    def _unpack(views: list[torch.Tensor], flat: torch.Tensor) -> None:
        offset = 0
        for view in views:
            view.copy_(flat[offset:offset + view.numel()].view_as(view))
            offset += view.numel()

    def _all_reduce(self, flat: torch.Tensor, members: tuple[int, ...]) -> float:
        """Sum `flat` over the holders `members` (blocking): hierarchically where enabled and they span nodes.
        Returns the seconds it took (wall clock; on CUDA only the time to enqueue)."""
        start = time.perf_counter()
        split = self.groups.node_splits.get(members) if self.hierarchical else None
        if split is not None:
            self.across_s += hier_all_reduce(flat, split, self.groups.rank, self.groups.node_groups)
        else:
            dist.all_reduce(flat, group=self.groups.dp_groups[members])
        return time.perf_counter() - start

    def _fill_missing(self) -> None:
        for _, param in self.params.values():
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    def reduce(self) -> None:
        """Blocking: sum every shared slice over the pipelines holding it (collective over the DP groups)."""
        self._fill_missing()
        self.busy_s = self.across_s = 0.0
        self.post_log = []
        for bucket in self.buckets:
            views, flat = self._pack(bucket)
            self.post_log.append((bucket.key, bucket.ranks))
            self.busy_s += self._all_reduce(flat, bucket.ranks)
            self._unpack(views, flat)

    # --- overlapped schedule -------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Arm the hooks for one step (call before the schedule, with the gradients zeroed or None)."""
        if self._posted:
            raise RuntimeError("GradSync.start_step before finish() of the previous step")
        self._counts = {}
        self._final = set()
        self._next = 0
        self.post_log = []
        self.busy_s = self.across_s = 0.0
        self.posted_in_backward = 0
        self._armed = self.overlap

    def _on_accumulated(self, name: str) -> None:
        """Post-accumulate-grad hook of parameter `name` (runs inside backward)."""
        if not self._armed:
            return
        count = self._counts.get(name, 0) + 1
        self._counts[name] = count
        if count >= self.num_micro:
            self._final.add(name)
            self._post_ready()

    def _post_ready(self) -> None:
        """Hand every bucket, in order from the next unposted one, whose parameters are all final."""
        while self._next < len(self.layer_buckets) and self._names[self._next] <= self._final:
            bucket = self.layer_buckets[self._next]
            self._next += 1
            with torch.no_grad():
                views, flat = self._pack(bucket)
            if self._pool is None:
                self._pool = _Reducer(f"ff-dp-r{self.groups.rank}")
            self.post_log.append((bucket.key, bucket.ranks))
            self._posted.append((bucket, views, flat, self._pool.submit(self._all_reduce, flat, bucket.ranks)))

    def finish(self) -> None:
        """After the schedule: post what is left (parameters that got no gradient count as zeros), wait for this
        rank's buckets, copy the sums back. Without overlap: the blocking `reduce()`."""
        if not self.overlap:
            self.reduce()
            return
        self.posted_in_backward = self._next
        self._fill_missing()
        self._final = set(self.params)
        self._post_ready()
        self._armed = False
        posted, self._posted = self._posted, []
        for _, views, flat, future in posted:
            self.busy_s += future.result()
            self._unpack(views, flat)

    def close(self) -> None:
        """Stop the reducer thread (idle between steps; a daemon, so it never holds the process at exit)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # --- norm and clipping ---------------------------------------------------------------------------------

    def global_norm(self) -> torch.Tensor:
        """L2 norm of the full gradient over unique parameters, an fp64 scalar on the device (collective over
        the world group; nothing waits for the device)."""
        device = next(iter(self.params.values()))[1].device
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for sl in self.owned:
            total += torch.linalg.vector_norm(self._view(sl)).double() ** 2  # fp32 norm, no fp64 copy
        dist.all_reduce(total, group=self.groups.world_group)
        return total.sqrt().squeeze(0)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale every local gradient by min(1, max_norm / (norm + 1e-6)) as torch's clip_grad_norm_ does;
        returns the norm before clipping (an fp64 device scalar, read by the caller when the step is done).
        `max_norm` 0 disables clipping (the norm is still computed). The factor stays on the device: the
        gradients are multiplied by it, 1 where no clipping is needed, without a host round trip."""
        norm = self.global_norm()
        if max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
            grads = [param.grad for _, param in self.params.values()]
            assert all(grad is not None for grad in grads)
            torch._foreach_mul_(grads, coef)
        return norm

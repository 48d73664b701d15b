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
  every bucket whose parameters are all final is packed at once and its collectives are issued, strictly in
  the global order (descending layer, embedding last), with `async_op=True` from the hook itself, while the
  backward of the lower layers goes on. A tied embedding's buckets (and so those after them in the order) are
  issued only after the whole pipeline schedule (`Bucket.after_schedule`). `finish()` issues what is left,
  waits for this rank's handles and copies the sums back.
Either way, with `hierarchical=True` a bucket whose holders span nodes is reduced by `hier_reduce` (inside each
node, across nodes by the leaders, back inside each node: a chain of three dependent collectives); otherwise by
one flat all-reduce. `collective_chain.ChainQueue` issues them: on NCCL every step at once, a later step
chained to the one before it through a side stream; on gloo a later step when the hooks find the one before it
complete. Why no helper thread: on NCCL a blocking collective blocks no thread; its `wait()` makes the calling
thread's current CUDA stream wait, and a helper thread's current stream is the default stream the backward and
the pipeline's transfers run on, so every bucket would hold up all later compute (the overlap lost, and with a
tied embedding a wait on the device in a cycle). Issuing from the training thread and waiting the handles at
`finish()` is what Megatron-LM and torch DDP do.

The gradient norm counts every finest slice once (on its `owner` rank) and is summed over the world group.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from ...semantics.parameters import ParamInfo
from .collective_chain import Chain, ChainQueue
from .grad_buckets import Bucket, holder_set_buckets, overlap_buckets, rank_buckets
from .groups import PlanGroups, SliceHolders
from .hier_reduce import hier_chain
from .shards import slice_view


def _call(this: weakref.ref[GradSync], name: str) -> None:
    """The post-accumulate-grad hook of parameter `name`: `GradSync._on_accumulated`, while the object lives."""
    sync = this()
    if sync is not None:
        sync._on_accumulated(name)


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
        self.busy_s = 0.0  # CPU: seconds some DP collective of the last step was in flight (wall time)
        self.across_s = 0.0  # of which a hierarchical reduction's cross-node step was (leaders only)
        self.posted_in_backward = 0  # buckets of the last step issued from hooks, before the schedule ended
        self._armed = False
        self._counts: dict[str, int] = {}
        self._final: set[str] = set()
        self._next = 0
        self._device = next(iter(params.values()))[1].device if params else torch.device("cpu")
        self._queue = ChainQueue(self._device)
        self._posted: list[tuple[list[torch.Tensor], torch.Tensor]] = []  # views and flat sums to copy back
        if overlap and self.layer_buckets:
            watched = set().union(*self._names)
            # The hooks live on the parameters, outside the garbage collector's reach (a tensor that autograd
            # also holds is not traversed), so they hold this object weakly: a dropped engine frees its
            # gradients, buffers and process groups (their gloo threads) instead of keeping them to the end.
            this = weakref.ref(self)
            for name in sorted(watched):
                self.params[name][1].register_post_accumulate_grad_hook(
                    lambda _p, name=name: _call(this, name))

    def _view(self, sl: SliceHolders) -> torch.Tensor:
        info, param = self.params[sl.name]
        assert param.grad is not None
        return slice_view(param.grad, info, sl, self.groups.tp_size, self.groups.tp_rank)

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

    def _chain(self, flat: torch.Tensor, members: tuple[int, ...]) -> Chain:
        """The collectives that sum `flat` over the holders `members`: hierarchical where enabled and they span
        nodes, else one all-reduce."""
        split = self.groups.node_splits.get(members) if self.hierarchical else None
        if split is not None:
            return hier_chain(flat, split, self.groups.rank, self.groups.node_groups)
        group = self.groups.dp_groups[members]
        return Chain([lambda: dist.all_reduce(flat, group=group, async_op=True)])

    def _post(self, bucket: Bucket) -> None:
        """Pack `bucket` and issue its collectives after those posted before it."""
        with torch.no_grad():
            views, flat = self._pack(bucket)
        self.post_log.append((bucket.key, bucket.ranks))
        self._posted.append((views, flat))
        self._queue.post(self._chain(flat, bucket.ranks))

    def _complete(self) -> None:
        """Wait for every posted bucket, copy the sums back, read the timings (CPU)."""
        self._queue.drain()
        posted, self._posted = self._posted, []
        for views, flat in posted:
            self._unpack(views, flat)
        self.busy_s, self.across_s = self._queue.seconds()

    def _fill_missing(self) -> None:
        for _, param in self.params.values():
            if param.grad is None:
                param.grad = torch.zeros_like(param)

    def _begin(self) -> None:
        if self._queue.busy or self._posted:
            raise RuntimeError("GradSync: a new step before finish() of the previous one")
        self.post_log = []
        self.busy_s = self.across_s = 0.0
        self._queue.reset_timing()

    def reduce(self) -> None:
        """Blocking: after the backward, sum every shared slice over the pipelines holding it, one bucket per
        holder set (collective over the DP groups)."""
        self._begin()
        self._fill_missing()
        for bucket in self.buckets:
            self._post(bucket)
        self._complete()

    # --- overlapped schedule -------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Arm the hooks for one step (call before the schedule, with the gradients zeroed or None)."""
        self._begin()
        self._counts = {}
        self._final = set()
        self._next = 0
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
            self._post_ready(in_schedule=True)
        self._queue.advance()  # gloo: issue the next step of a chain whose step before it is complete

    def _post_ready(self, in_schedule: bool) -> None:
        """Post every bucket, in order from the next unposted one, whose parameters are all final; inside the
        schedule, stop at a tied embedding's bucket (`Bucket.after_schedule`)."""
        while self._next < len(self.layer_buckets) and self._names[self._next] <= self._final:
            bucket = self.layer_buckets[self._next]
            if in_schedule and bucket.after_schedule:
                return
            self._next += 1
            self._post(bucket)

    def finish(self) -> None:
        """After the schedule: post what is left (parameters that got no gradient count as zeros), wait for this
        rank's buckets, copy the sums back. Without overlap: the blocking `reduce()`."""
        if not self.overlap:
            self.reduce()
            return
        self.posted_in_backward = self._next
        self._armed = False
        self._fill_missing()
        self._final = set(self.params)
        self._post_ready(in_schedule=False)
        self._complete()

    def close(self) -> None:
        """Drop what a failed step left in flight (nothing runs between steps; no thread to stop)."""
        self._queue = ChainQueue(self._device)
        self._posted = []

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

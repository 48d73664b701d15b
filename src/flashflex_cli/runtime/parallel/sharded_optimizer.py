"""Optimizer state sharded across unlike data-parallel replicas (ZeRO-1 style, shard sizes per holder chosen).

Why hand-written: torch's ZeroRedundancyOptimizer and FSDP (and Megatron's distributed optimizer, DeepSpeed ZeRO,
torchtitan's FSDP2) shard over one data-parallel group of equal replicas, each holding the same parameters in the
same layout, in equal parts. Here every finest parameter slice has its own holder set (pipelines with other stage
splits and TP degrees hold it, a tied embedding's two ends too), and the parts are sized to each holder
(semantics/optimizer_shards.py: which rank holds which range of which slice, shared with the cost model and the
checkpoints).

Per step, for each gradient bucket (runtime/parallel/grad_buckets.py: same buckets, same global order as the
unsharded reduction, so the overlap with backward and the deadlock argument carry over):

1. pack: one chunk per holder, the bucket's slices' pieces of that holder in slice order (this rank's gradient
   where it contributes, zeros elsewhere), chunks back to back: a flat fp32 buffer as long as the bucket;
2. reduce each holder's chunk to that holder (one `reduce` per holder, chained in holder order). Why not
   `reduce_scatter_tensor`: gloo and NCCL both need equal chunks, and padding each chunk to the widest holder's
   costs (holders x widest - bucket) elements of buffer, half again the bucket when one holder takes three
   quarters (and gloo's reduce-scatter copies its input besides); a reduce per chunk moves the same bytes per
   link as a ring reduce-scatter, with no padding, in holders times the latency-bound steps. With
   `hierarchical=True` and holders spanning nodes, the fallback is the hierarchical all-reduce of the whole
   buffer (runtime/parallel/hier_reduce.py) and this rank keeps its chunk: the memory saving holds, the bytes
   on the wire are those of today's all-reduce;
3. the fp32 master weights of this rank's pieces are views of its own fp32 parameters (the runtime keeps no
   separate low-precision copy), and torch.optim.AdamW updates exactly those views, whose gradients are views of
   this rank's chunk (copied out of the buffer): AdamW's moments exist for this rank's pieces only;
4. gather (after the optimizer step, per layer bucket in forward order, the reverse of the global backward
   order): each holder broadcasts its chunk to the others, who copy it into their parameters (an all-gather of
   unequal chunks, unpadded). The broadcasts are posted and left in flight: the next step's forward lands each
   bucket just before the first use of its parameters (`wait_for_parameters`, from the stage's forward
   pre-hooks), so the gather overlaps the step's end and the compute of the earlier layers; whatever reads the
   parameters between steps (checkpoints, exports, the end of training) lands them all first.

The full gradient of a sharded parameter is dropped once its last bucket is packed. Parameters that one stage alone holds are
not sharded (their state stays where it is). The gradient norm sums this rank's pieces and the slices it owns
and are not sharded, over the world group: every element once. fp16 loss scaling unscales and checks the
optimizer's gradients (`JobScaler` over this optimizer), so it sees the sharded gradients and the job's flag.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...semantics.optimizer_shards import ShardPiece
from ...semantics.parameters import ParamInfo
from .collective_chain import Chain, Step
from .grad_buckets import Bucket
from .grad_sync import GradSync
from .groups import PlanGroups, SliceHolders
from .hier_reduce import hier_chain


@dataclass
class _Gather:
    """One bucket's broadcasts in flight: the parameters it holds (global names), the works, the buffer and its
    layout (per holder, holder order: its pieces)."""

    names: frozenset[str]
    works: list[dist.Work]
    flat: torch.Tensor
    chunks: list[list[ShardPiece]]


def _reduce_step(chunk: torch.Tensor, holder: int, group: dist.ProcessGroup) -> Step:
    """A chain step: sum `chunk` (a contiguous part of a bucket's buffer) over `group` into `holder`'s copy."""
    return lambda: dist.reduce(chunk, dst=holder, group=group, async_op=True)


class ShardedGradSync(GradSync):
    """GradSync that reduces each holder's chunk of every bucket to that holder (module docstring). `pieces`: every
    piece of the plan (semantics/optimizer_shards.plan_pieces, over `groups.slices`)."""

    def __init__(self, params: dict[str, tuple[ParamInfo, torch.nn.Parameter]], groups: PlanGroups,
                 pieces: list[ShardPiece], overlap: bool = False, hierarchical: bool = False,
                 num_micro: int = 1) -> None:
        super().__init__(params, groups, overlap=overlap, hierarchical=hierarchical, num_micro=num_micro)
        by_slice: dict[int, list[ShardPiece]] = {}
        for piece in pieces:
            by_slice.setdefault(piece.slice_index, []).append(piece)
        index = {sl: i for i, sl in enumerate(groups.slices)}
        self._contributes = {i for i, sl in enumerate(groups.slices) if groups.rank in sl.contributors}
        # per slice this rank holds and that is sharded: its pieces, one per holder (holder order)
        self.slice_pieces: dict[SliceHolders, list[ShardPiece]] = {
            sl: by_slice[index[sl]] for sl in groups.slices if groups.rank in sl.ranks and index[sl] in by_slice}
        self.sharded = {sl.name for sl in self.slice_pieces}
        self.own: list[ShardPiece] = [p for pieces_ in self.slice_pieces.values() for p in pieces_
                                      if p.rank == groups.rank]
        self.leaves: dict[ShardPiece, torch.Tensor] = {p: self.piece_view(p, self.params[p.name][1].detach())
                                                       for p in self.own}
        self.owned = [sl for sl in self.owned if sl.name not in self.sharded]  # norm: unsharded slices it owns
        self._received: list[tuple[Bucket, torch.Tensor]] = []  # this step's buckets and this rank's chunk
        self._packs = {name: sum(name in bucket.names for bucket in self.schedule) for name in self.sharded}
        self._packs_left = dict(self._packs)  # per sharded parameter: its buckets not yet packed this step
        self._pending: list[_Gather] = []  # the parameters' gathers posted after the last update, not yet landed

    @property
    def schedule(self) -> list[Bucket]:
        """The buckets in the order this rank reduces and gathers them."""
        return self.layer_buckets if self.overlap else self.buckets

    def piece_view(self, piece: ShardPiece, local: torch.Tensor) -> torch.Tensor:
        """The part of this rank's local tensor `local` (a parameter's shape, or its gradient's) that is
        `piece` (a view, possibly strided)."""
        info = self.params[piece.name][0]
        offset = info.bounds(self.groups.tp_size, self.groups.tp_rank)[0] if info.shard_dim is not None else 0
        return local.narrow(piece.dim, piece.start - offset, piece.stop - piece.start)

    def optimizer_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What torch.optim.AdamW updates on this rank: (name, tensor) for every parameter that is not sharded
        (the parameter itself) and every piece of this rank (a view of its parameter, shaped like it: 2-D
        pieces keep their weight decay)."""
        for name, (_, param) in self.params.items():
            if name not in self.sharded:
                yield name, param
        for piece, leaf in self.leaves.items():
            yield f"{piece.name}@{piece.dim}:{piece.start}:{piece.stop}", leaf

    def _layout(self, bucket: Bucket) -> tuple[list[list[ShardPiece]], list[int]]:
        """Per holder of `bucket` (holder order): its pieces in the bucket's slice order, and their elements."""
        chunks: list[list[ShardPiece]] = [[] for _ in bucket.ranks]
        position = {rank: i for i, rank in enumerate(bucket.ranks)}
        for sl in bucket.slices:
            for piece in self.slice_pieces[sl]:
                chunks[position[piece.rank]].append(piece)
        return chunks, [sum(p.numel for p in chunk) for chunk in chunks]

    def _post(self, bucket: Bucket) -> None:
        """Pack `bucket` by holder and issue one reduce per holder's chunk (or the hierarchical all-reduce);
        drop the full gradient of every parameter whose last bucket this is."""
        self.wait_for_parameters()  # any gather the forward did not land (a parameter it did not read)
        chunks, lengths = self._layout(bucket)
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        with torch.no_grad():
            flat = torch.zeros(sum(lengths), dtype=torch.float32, device=self._device)
            for chunk, offset in zip(chunks, starts, strict=True):
                for piece in chunk:
                    grad = self.params[piece.name][1].grad
                    if piece.slice_index in self._contributes and grad is not None:
                        view = self.piece_view(piece, grad)
                        flat[offset:offset + piece.numel].view(view.shape).copy_(view)
                    offset += piece.numel
        for name in bucket.names:
            self._packs_left[name] -= 1
            if self._packs_left[name] == 0:
                self.params[name][1].grad = None  # packed everywhere it is needed: the pieces take over
        me = bucket.ranks.index(self.groups.rank)
        self.post_log.append((bucket.key, bucket.ranks))
        self._received.append((bucket, flat.narrow(0, starts[me], lengths[me])))
        split = self.groups.node_splits.get(bucket.ranks) if self.hierarchical else None
        if split is not None:  # fallback: the hierarchical all-reduce of the whole buffer, keep this rank's chunk
            self._queue.post(hier_chain(flat, split, self.groups.rank, self.groups.node_groups))
            return
        group = self.groups.dp_groups[bucket.ranks]
        self._queue.post(Chain([_reduce_step(flat.narrow(0, start, length), holder, group)
                                for holder, start, length in zip(bucket.ranks, starts, lengths, strict=True)
                                if length > 0]))

    def _complete(self) -> None:
        """Wait for every bucket; copy this rank's chunks out (their buffers go) and point each of its pieces'
        gradient at its part."""
        self._queue.drain()
        received, self._received = self._received, []
        for bucket, view in received:
            chunk = view.clone()
            offset = 0
            for sl in bucket.slices:
                for piece in self.slice_pieces[sl]:
                    if piece.rank == self.groups.rank:
                        leaf = self.leaves[piece]
                        leaf.grad = chunk[offset:offset + piece.numel].view(leaf.shape)
                        offset += piece.numel
        self.busy_s, self.across_s = self._queue.seconds()

    def _begin(self) -> None:
        super()._begin()
        self._packs_left = dict(self._packs)

    def _fill_missing(self) -> None:
        for name, (_, param) in self.params.items():
            if param.grad is None and name not in self.sharded:
                param.grad = torch.zeros_like(param)

    def close(self) -> None:
        super().close()
        self._received = []
        self._pending = []

    # --- norm, clipping, the gathers after the update --------------------------------------------------------

    def local_grads(self) -> list[torch.Tensor]:
        """The gradients the optimizer reads on this rank (unsharded parameters', this rank's pieces')."""
        grads = [param.grad for name, (_, param) in self.params.items() if name not in self.sharded]
        grads += [leaf.grad for leaf in self.leaves.values()]
        return [grad for grad in grads if grad is not None]

    def global_norm(self) -> torch.Tensor:
        """L2 norm over every element of the job's gradient once: this rank's pieces plus the unsharded slices
        it owns, summed over the world group (an fp64 device scalar)."""
        total = torch.zeros(1, dtype=torch.float64, device=self._device)
        for sl in self.owned:
            total += torch.linalg.vector_norm(self._view(sl)).double() ** 2
        for leaf in self.leaves.values():
            if leaf.grad is not None:
                total += torch.linalg.vector_norm(leaf.grad).double() ** 2
        dist.all_reduce(total, group=self.groups.world_group)
        return total.sqrt().squeeze(0)

    def clip(self, max_norm: float) -> torch.Tensor:
        """As GradSync.clip, over the gradients the optimizer reads (`local_grads`)."""
        norm = self.global_norm()
        if max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
            torch._foreach_mul_(self.local_grads(), coef)
        return norm

    def _issue(self, bucket: Bucket, source: Callable[[ShardPiece], torch.Tensor]) -> _Gather:
        """Pack this rank's pieces of `bucket` (`source(piece)`: this rank's value of its own piece) and post
        every holder's broadcast of its chunk (async)."""
        chunks, lengths = self._layout(bucket)
        me = bucket.ranks.index(self.groups.rank)
        group = self.groups.dp_groups[bucket.ranks]
        with torch.no_grad():
            flat = torch.empty(sum(lengths), dtype=torch.float32, device=self._device)
            offset = sum(lengths[:me])
            for piece in chunks[me]:
                value = source(piece)
                flat[offset:offset + piece.numel].view(value.shape).copy_(value)
                offset += piece.numel
        offset, works = 0, []
        for holder, length in zip(bucket.ranks, lengths, strict=True):
            if length > 0:
                works.append(dist.broadcast(flat.narrow(0, offset, length), src=holder, group=group,
                                            async_op=True))
            offset += length
        return _Gather(bucket.names, works, flat, chunks)

    @staticmethod
    def _land(gather: _Gather, target: Callable[[ShardPiece], torch.Tensor]) -> None:
        """Wait for `gather`'s broadcasts and copy every holder's piece to `target(piece)` on this rank (this
        rank's own pieces too: a no-op for the parameters)."""
        for work in gather.works:
            work.wait()
        offset = 0
        with torch.no_grad():
            for chunk in gather.chunks:
                for piece in chunk:
                    out = target(piece)
                    out.copy_(gather.flat[offset:offset + piece.numel].view(out.shape))
                    offset += piece.numel

    def gather(self, source: Callable[[ShardPiece], torch.Tensor],
               target: Callable[[ShardPiece], torch.Tensor]) -> None:
        """For every bucket (this rank's, global order), every holder broadcasts its pieces to the others:
        `source(piece)` this rank's value of its own piece, `target(piece)` where every holder's piece goes on
        this rank (one bucket at a time: transient memory of the largest bucket's buffer). Blocking; the
        parameters' gathers still in flight land first."""
        self.wait_for_parameters()
        for bucket in self.schedule:
            self._land(self._issue(bucket, source), target)

    def _param_target(self, piece: ShardPiece) -> torch.Tensor:
        return self.piece_view(piece, self.params[piece.name][1].detach())

    def gather_params(self) -> None:
        """After the optimizer step: post every holder's broadcast of its updated pieces, per layer bucket in
        forward order (embedding, layers first to last, final norm, head: the reverse of the global backward
        order, so as consistent across ranks), and return without waiting. The pieces land in the parameters
        at `wait_for_parameters`, which the stage's forward calls part by part before its first use of them:
        the gathers overlap the step's end and the compute of earlier parts. Until then each bucket's buffer
        is held (at most this rank's sharded parameters once more, in fp32)."""
        self.wait_for_parameters()
        self._pending = [self._issue(bucket, lambda piece: self.leaves[piece])
                         for bucket in reversed(self.layer_buckets)]

    def wait_for_parameters(self, names: Collection[str] | None = None) -> None:
        """Land the parameter gathers still in flight that hold any of `names` (global names; None: all), in
        the order they were posted: after this, those parameters hold every holder's update."""
        if not self._pending:
            return
        wanted = None if names is None else frozenset(names)
        keep: list[_Gather] = []
        for posted in self._pending:
            if wanted is None or not posted.names.isdisjoint(wanted):
                self._land(posted, self._param_target)
            else:
                keep.append(posted)
        self._pending = keep

    @property
    def pending_parameters(self) -> frozenset[str]:
        """The global names of the parameters whose gathered update has not landed yet."""
        return frozenset().union(*(posted.names for posted in self._pending))

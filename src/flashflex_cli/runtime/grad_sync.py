"""Gradient sync across unlike pipelines and global-norm clipping.

After backward, every rank holds the gradient of its local shards (replicated parameters such as norm weights
carry the same, full gradient on every rank of a TP group). For each finest common slice held by two or more
stages (`groups.SliceHolders`: one per pipeline, plus the last stage's copy of a tied embedding), the holders
all-reduce (sum) that slice, where one rank per holding stage contributes its gradient and the other ranks of
the same stage contribute zeros, so each stage is counted exactly once whatever its TP degree; the two ends of a
tied embedding thus add their partial gradients. Slices with the same holder set are packed into one flat buffer per
all-reduce (a bucket); buckets are reduced in one global order (sorted holder tuples) on every rank, so the
blocking collectives cannot deadlock.

The gradient norm counts every finest slice once (on its `owner` rank) and is summed over the world group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .groups import PlanGroups, SliceHolders
from .model import ParamInfo


def _local_view(grad: torch.Tensor, info: ParamInfo, sl: SliceHolders, tp: int, tp_rank: int) -> torch.Tensor:
    """The part of this rank's shard gradient that is slice `sl` of the full tensor (a view)."""
    if sl.dim is None:
        return grad
    start, _ = info.bounds(tp, tp_rank)
    return grad.narrow(sl.dim, sl.start - start, sl.stop - sl.start)


class GradSync:
    """Data-parallel reduction of this rank's shard gradients. `params` maps global name -> (info, parameter)."""

    def __init__(self, params: dict[str, tuple[ParamInfo, torch.nn.Parameter]], groups: PlanGroups) -> None:
        self.params, self.groups = params, groups
        mine = [sl for sl in groups.slices if groups.rank in sl.ranks]
        self.buckets: list[tuple[tuple[int, ...], list[SliceHolders]]] = []
        by_set: dict[tuple[int, ...], list[SliceHolders]] = {}
        for sl in mine:
            if sl.needs_reduce:
                by_set.setdefault(sl.ranks, []).append(sl)
        for members in sorted(by_set):
            self.buckets.append((members, by_set[members]))
        self.owned = [sl for sl in mine if sl.owner == groups.rank]

    def _view(self, sl: SliceHolders) -> torch.Tensor:
        info, param = self.params[sl.name]
        assert param.grad is not None
        return _local_view(param.grad, info, sl, self.groups.tp_size, self.groups.tp_rank)

    def reduce(self) -> None:
        """Sum every shared slice over the pipelines holding it (collective over the DP groups)."""
        for _, param in self.params.values():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        for members, slices in self.buckets:
            views = [self._view(sl) for sl in slices]
            flat = torch.cat([
                v.reshape(-1) if self.groups.rank in sl.contributors else torch.zeros(v.numel(), dtype=v.dtype,
                                                                                      device=v.device)
                for v, sl in zip(views, slices, strict=True)
            ])
            dist.all_reduce(flat, group=self.groups.dp_groups[members])
            offset = 0
            for view in views:
                view.copy_(flat[offset:offset + view.numel()].view_as(view))
                offset += view.numel()

    def global_norm(self) -> float:
        """L2 norm of the full gradient over unique parameters (collective over the world group)."""
        device = next(iter(self.params.values()))[1].device
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for sl in self.owned:
            total += torch.linalg.vector_norm(self._view(sl)).double() ** 2  # fp32 norm, no fp64 copy
        dist.all_reduce(total, group=self.groups.world_group)
        return math.sqrt(float(total.item()))

    def clip(self, max_norm: float) -> float:
        """Scale every local gradient by min(1, max_norm / (norm + 1e-6)) as torch's clip_grad_norm_ does;
        returns the norm before clipping. `max_norm` 0 disables clipping (the norm is still computed)."""
        norm = self.global_norm()
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                for _, param in self.params.values():
                    assert param.grad is not None
                    param.grad.mul_(coef)
        return norm

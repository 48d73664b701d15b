"""The outer step of low-communication training (DiLoCo, arXiv 2311.08105, Algorithm 1), on one rank.

Every rank keeps the global parameters of its shards (`anchors`, fp32, the local shapes). At the end of a round:
1. pseudo-gradient = anchor - local parameter (what the round's inner steps moved, sign as a gradient);
2. its finest common slices across every pipeline of the plan (semantics/process_groups.outer_slice_holders:
   the same slicing the gradient sync uses, over all groups at once, since groups may split the model
   differently) are all-reduced among their holders in the plan's compression dtype (fp32 or bf16), each holding
   stage contributing once with the weight of its group's share of the round's tokens
   (semantics/outer_sync.group_weights), divided among that group's holding stages, so the sum is the
   token-weighted mean of the groups' pseudo-gradients;
3. torch.optim.SGD(nesterov=True) takes one step on the anchors with that mean as their gradient (lr 0.7, momentum
   0.9 by default);
4. every rank copies its anchors into its parameters: each group starts the next round from the global ones.

The inner optimizer's state (AdamW moments) stays with each group, as in DiLoCo.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ...errors import InputError
from ...semantics.outer_sync import group_of_pipeline, group_weights
from ...semantics.parameters import ParamInfo
from ...semantics.process_groups import outer_slice_holders
from .groups import PlanGroups
from .shards import slice_view

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MOMENTUM_SUFFIX = ".outer_momentum"
ROUND_KEY = "outer_round"


class OuterSync:
    """The outer step of `plan` (which has an `outer_sync` section) for the shards `params` (global name ->
    (info, parameter)) of rank `groups.rank`. `bytes_sent`: payload bytes this rank has all-reduced so far (the
    compressed buffers; a ring all-reduce moves about twice that over each link); `comm_seconds`: seconds spent in
    those collectives; `round`: outer steps taken."""

    def __init__(self, plan: Any, params: dict[str, tuple[ParamInfo, torch.nn.Parameter]],
                 groups: PlanGroups) -> None:
        outer = plan.outer_sync
        if outer is None:
            raise InputError("the plan has no outer_sync section: it trains synchronously")
        if outer.compression not in WIRE_DTYPES:
            raise InputError(f"outer_sync.compression {outer.compression} is not implemented by this runtime "
                             f"(use {' or '.join(WIRE_DTYPES)})")
        if outer.fragments != 1:
            raise InputError(f"outer_sync.fragments {outer.fragments}: streamed fragments are not implemented by "
                             "this runtime (use 1)")
        self.params, self.groups = params, groups
        self.wire_dtype = WIRE_DTYPES[outer.compression]
        self.anchors: dict[str, torch.Tensor] = {name: param.detach().clone() for name, (_, param) in params.items()}
        self.optimizer = torch.optim.SGD(list(self.anchors.values()), lr=outer.optimizer.lr,
                                         momentum=outer.optimizer.momentum,
                                         nesterov=outer.optimizer.nesterov and outer.optimizer.momentum > 0)
        ranks = plan.ranks()
        rank_group = [group_of_pipeline(plan, info.pipeline) for info in ranks]
        weights = group_weights(plan)
        mine = [sl for sl in outer_slice_holders(plan) if groups.rank in sl.ranks]
        self.scales: dict[int, float] = {}  # index into `mine` -> this rank's factor (0: contributes zeros)
        self.buckets: dict[tuple[int, ...], list[int]] = {}
        for i, sl in enumerate(mine):
            if groups.rank in sl.contributors:
                group = rank_group[groups.rank]
                same = sum(1 for r in sl.contributors if rank_group[r] == group)
                self.scales[i] = weights[group] / same
            else:
                self.scales[i] = 0.0
            self.buckets.setdefault(sl.ranks, []).append(i)
        self.slices = mine
        self.round = 0
        self.bytes_sent = 0
        self.comm_seconds = 0.0

    def _view(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        sl = self.slices[index]
        return slice_view(tensor, self.params[sl.name][0], sl, self.groups.tp_size, self.groups.tp_rank)

    def step(self) -> None:
        """Take the outer step (collective over every rank of the job, at the same round on all)."""
        with torch.no_grad():
            deltas = {name: self.anchors[name] - param.detach() for name, (_, param) in self.params.items()}
            for anchor in self.anchors.values():
                anchor.grad = torch.zeros_like(anchor)
            for members in sorted(self.buckets):  # one global order: no two ranks wait on each other
                indices = self.buckets[members]
                parts = []
                for i in indices:
                    name = self.slices[i].name
                    view = self._view(deltas[name], i)
                    parts.append((view * self.scales[i]).reshape(-1) if self.scales[i] else
                                 torch.zeros(view.numel(), dtype=view.dtype, device=view.device))
                flat = torch.cat(parts).to(self.wire_dtype)
                if len(members) > 1:
                    start = time.perf_counter()
                    dist.all_reduce(flat, group=self.groups.outer_groups[members])
                    self.comm_seconds += time.perf_counter() - start
                    self.bytes_sent += flat.numel() * flat.element_size()
                offset = 0
                for i in indices:
                    grad = self._view(self.anchors[self.slices[i].name].grad, i)
                    grad.copy_(flat[offset:offset + grad.numel()].view(grad.shape))
                    offset += grad.numel()
            self.optimizer.step()
            for name, (_, param) in self.params.items():
                param.copy_(self.anchors[name])
                self.anchors[name].grad = None
        self.round += 1

    def momentum(self, name: str) -> torch.Tensor:
        """The outer momentum buffer of parameter `name` (zeros before the first outer step)."""
        state = self.optimizer.state.get(self.anchors[name], {})
        buffer = state.get("momentum_buffer")
        return buffer if buffer is not None else torch.zeros_like(self.anchors[name])

    def state(self) -> dict[str, torch.Tensor]:
        """Checkpoint entries: "<name>.outer_momentum" per parameter (local shard) and "outer_round" (int64). The
        global parameters are the parameters themselves at a round's end (the outer step just set them)."""
        out = {f"{name}{MOMENTUM_SUFFIX}": self.momentum(name).detach() for name in self.anchors}
        out[ROUND_KEY] = torch.tensor(self.round, dtype=torch.int64)
        return out

    def load(self, momenta: dict[str, torch.Tensor], round_index: int) -> None:
        """Resume: the anchors from the parameters as they are now (loaded), the momentum buffers from `momenta`
        (local shards; a zero buffer is what torch's first step would start from), the round count."""
        with torch.no_grad():
            for name, (_, param) in self.params.items():
                self.anchors[name].copy_(param.detach())
                self.optimizer.state[self.anchors[name]] = {"momentum_buffer": momenta[name].clone()}
        self.round = round_index

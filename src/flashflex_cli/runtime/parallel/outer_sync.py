"""The outer step of low-communication training (DiLoCo, arXiv 2311.08105, Algorithm 1), on one rank.

Every rank keeps the global parameters of its shards (`anchors`, fp32, the local shapes). At the end of a round:
1. pseudo-gradient = anchor - local parameter (what the round's inner steps moved, sign as a gradient);
2. its finest common slices across every pipeline of the plan (semantics/process_groups.outer_slice_holders:
   the same slicing the gradient sync uses, over all groups at once, since groups may split the model
   differently) are summed among their holders in the plan's compression dtype, each holding
   stage contributing once with the weight of its group's share of the round's tokens
   (semantics/outer_sync.group_weights), divided among that group's holding stages, so the sum is the
   token-weighted mean of the groups' pseudo-gradients. fp32 and bf16: an all-reduce in that dtype. int8: each
   holder quantizes its term per block of `INT8_BLOCK` elements (symmetric absmax, an fp32 scale per block:
   `quantize_int8`), the holders all-gather the int8 payloads and scales (an int8 all-reduce would overflow), and
   every holder dequantizes them and sums them in fp32 in the holders' rank order, so all compute bitwise the same
   sum;
3. torch.optim.SGD(nesterov=True) takes one step on the anchors with that mean as their gradient (lr 0.7, momentum
   0.9 by default);
4. every rank copies its anchors into its parameters: each group starts the next round from the global ones.

The inner optimizer's state (AdamW moments) stays with each group, as in DiLoCo.

Streamed fragments (semantics/outer_sync.py, `fragments` > 1): `step(fragment)` does the above for the parameters
of one fragment only (the other anchors, their momentum and parameters are untouched); the round count advances
with the last fragment's step. Between a fragment's steps the parameters drift from the anchors, so a checkpoint
then holds the anchors too ("<name>.outer_anchor").

Overlapped exchanges (Streaming DiLoCo, arXiv 2501.18512, `overlap_steps` > 0): `begin(fragment)` computes the
pseudo-gradients and starts their collectives without waiting (async_op; int8 sums after the wait), the caller
trains on, and `finish(alpha)` waits for the oldest exchange begun, takes its outer step on the anchors and merges
them into the parameters: parameter = alpha * parameter + (1 - alpha) * anchor. `step` is `begin` then
`finish(0)`. `state` refuses while an exchange is in flight (the caller finishes it first: `flush`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...errors import InputError
from ...semantics.outer_sync import (
    INT8_BLOCK,
    group_of_pipeline,
    group_weights,
    param_fragment,
    plan_fragments,
)
from ...semantics.parameters import ParamInfo
from ...semantics.process_groups import outer_slice_holders
from .groups import PlanGroups
from .shards import slice_view

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
MOMENTUM_SUFFIX = ".outer_momentum"
ANCHOR_SUFFIX = ".outer_anchor"
ROUND_KEY = "outer_round"


def quantize_int8(flat: torch.Tensor, block: int = INT8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 quantization of `flat` (fp32 [n]) per block of `block` consecutive elements (the last
    one may be shorter): (payload int8 [n], scales fp32 [ceil(n / block)]), scale = the block's absmax / 127 (0 for
    an all-zero block), payload = round(x / scale). Each element's error after `dequantize_int8` is at most half
    its block's scale (absmax / 254), up to fp32 rounding."""
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat.float(), (0, -n % block)).view(-1, block)
    scales = blocks.abs().amax(dim=1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    payload = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return payload.reshape(-1)[:n], scales


def dequantize_int8(payload: torch.Tensor, scales: torch.Tensor, block: int = INT8_BLOCK) -> torch.Tensor:
    """The fp32 [n] values of `quantize_int8`'s (payload int8 [n], scales fp32 [ceil(n / block)])."""
    n = payload.numel()
    blocks = torch.nn.functional.pad(payload.float(), (0, -n % block)).view(-1, block)
    return (blocks * scales[:, None]).reshape(-1)[:n]


@dataclass
class _Bucket:
    """One outer bucket's exchange in flight: its slice indices (into `OuterSync.slices`), the buffers the
    collectives fill (fp32/bf16: the summed flat [n]; int8: the holders' payloads [n] and scales [ceil(n / block)],
    or one fp32 [n] result without a collective) and their handles (empty: nothing to wait for)."""

    indices: list[int]
    flat: torch.Tensor | None = None
    payloads: list[torch.Tensor] = field(default_factory=list)
    scales: list[torch.Tensor] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)


@dataclass
class Exchange:
    """The outer exchange of fragment `fragment` (None: every fragment) begun and not yet applied: the names of
    its parameters and its buckets in the global order."""

    fragment: int | None
    names: list[str]
    buckets: list[_Bucket]


class OuterSync:
    """The outer step of `plan` (which has an `outer_sync` section) for the shards `params` (global name ->
    (info, parameter)) of rank `groups.rank`. `bytes_sent`: payload bytes this rank has contributed so far (the
    compressed buffers, int8: payload and fp32 scales; a ring all-reduce moves about twice that over each link, a
    ring all-gather n-1 times it among n holders); `comm_seconds`: seconds spent starting and waiting for those
    collectives (an overlapped exchange's time hidden behind inner steps is not counted); `round`:
    rounds of outer steps taken (every fragment's)."""

    def __init__(self, plan: Any, params: dict[str, tuple[ParamInfo, torch.nn.Parameter]],
                 groups: PlanGroups) -> None:
        outer = plan.outer_sync
        if outer is None:
            raise InputError("the plan has no outer_sync section: it trains synchronously")
        if outer.compression not in WIRE_DTYPES:
            raise InputError(f"outer_sync.compression {outer.compression} is not implemented by this runtime "
                             f"(use {' or '.join(WIRE_DTYPES)})")
        self.params, self.groups = params, groups
        self.fragments = plan_fragments(plan)
        # the parameters differ from the anchors at a round's end: fragments mid-way, or a merge that kept some of
        # the local parameters (merge_alpha > 0); then checkpoints hold the anchors too
        self.saves_anchors = self.fragments > 1 or outer.merge_alpha > 0
        layers = plan.inputs.model.num_layers
        self.fragment_of = {name: param_fragment(name, layers, self.fragments) for name in params}
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
        self.buckets: dict[tuple[int, tuple[int, ...]], list[int]] = {}  # (fragment, holders) -> slices
        for i, sl in enumerate(mine):
            if groups.rank in sl.contributors:
                group = rank_group[groups.rank]
                same = sum(1 for r in sl.contributors if rank_group[r] == group)
                self.scales[i] = weights[group] / same
            else:
                self.scales[i] = 0.0
            self.buckets.setdefault((param_fragment(sl.name, layers, self.fragments), sl.ranks), []).append(i)
        self.slices = mine
        self.pending: deque[Exchange] = deque()  # exchanges begun, not yet finished, oldest first
        self.round = 0
        self.bytes_sent = 0
        self.comm_seconds = 0.0

    def _view(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        sl = self.slices[index]
        return slice_view(tensor, self.params[sl.name][0], sl, self.groups.tp_size, self.groups.tp_rank)

    def step(self, fragment: int | None = None) -> None:
        """Take the outer step of fragment `fragment` (None: of every fragment), collective over every rank of the
        job, at the same round and fragment on all; the round count advances with the last fragment."""
        self.begin(fragment)
        self.finish()

    def begin(self, fragment: int | None = None) -> None:
        """Compute the pseudo-gradients of fragment `fragment` (None: every fragment) and start their exchange
        without waiting (collective over every rank of the job, in the same order on all); the round count
        advances with the last fragment's."""
        names = [n for n in self.params if fragment is None or self.fragment_of[n] == fragment]
        buckets = []
        with torch.no_grad():
            deltas = {name: self.anchors[name] - self.params[name][1].detach() for name in names}
            # one global order: no two ranks wait on each other
            for key in sorted(k for k in self.buckets if fragment is None or k[0] == fragment):
                members, indices = key[1], self.buckets[key]
                parts = []
                for i in indices:
                    view = self._view(deltas[self.slices[i].name], i)
                    parts.append((view * self.scales[i]).reshape(-1) if self.scales[i] else
                                 torch.zeros(view.numel(), dtype=view.dtype, device=view.device))
                buckets.append(self._start(torch.cat(parts), members, indices))
        self.pending.append(Exchange(fragment, names, buckets))
        if fragment is None or fragment == self.fragments - 1:
            self.round += 1

    def finish(self, alpha: float = 0.0) -> None:
        """Wait for the oldest exchange begun, take its outer step on the anchors and merge them into the
        parameters: parameter = alpha * parameter + (1 - alpha) * anchor (alpha 0: a copy of the anchors)."""
        exchange = self.pending.popleft()
        with torch.no_grad():
            for name in exchange.names:
                self.anchors[name].grad = torch.zeros_like(self.anchors[name])
            for bucket in exchange.buckets:
                flat = self._wait(bucket)
                offset = 0
                for i in bucket.indices:
                    grad = self._view(self.anchors[self.slices[i].name].grad, i)
                    grad.copy_(flat[offset:offset + grad.numel()].view(grad.shape))
                    offset += grad.numel()
            self.optimizer.step()  # anchors without a gradient (other fragments) are skipped
            for name in exchange.names:
                param = self.params[name][1]
                if alpha == 0.0:
                    param.copy_(self.anchors[name])
                else:
                    param.mul_(alpha).add_(self.anchors[name], alpha=1.0 - alpha)
                self.anchors[name].grad = None

    def flush(self, alpha: float = 0.0) -> None:
        """Finish every exchange in flight (`finish`), oldest first."""
        while self.pending:
            self.finish(alpha)

    def _start(self, flat: torch.Tensor, members: tuple[int, ...], indices: list[int]) -> _Bucket:
        """Start summing over `members` their fp32 terms `flat` [n] through the wire dtype (asynchronously)."""
        bucket = _Bucket(indices)
        start = time.perf_counter()
        if self.wire_dtype != torch.int8:
            bucket.flat = flat.to(self.wire_dtype)
            if len(members) > 1:
                bucket.handles.append(dist.all_reduce(bucket.flat, group=self.groups.outer_groups[members],
                                                      async_op=True))
                self.bytes_sent += bucket.flat.numel() * bucket.flat.element_size()
        else:
            payload, scales = quantize_int8(flat)
            if len(members) == 1:
                bucket.flat = dequantize_int8(payload, scales)
            else:
                group = self.groups.outer_groups[members]
                bucket.payloads = [torch.empty_like(payload) for _ in members]
                bucket.scales = [torch.empty_like(scales) for _ in members]
                bucket.handles.append(dist.all_gather(bucket.payloads, payload, group=group, async_op=True))
                bucket.handles.append(dist.all_gather(bucket.scales, scales, group=group, async_op=True))
                self.bytes_sent += payload.numel() * payload.element_size() + scales.numel() * scales.element_size()
        self.comm_seconds += time.perf_counter() - start
        return bucket

    def _wait(self, bucket: _Bucket) -> torch.Tensor:
        """The sum `_start` began: fp32 [n] (or the wire dtype, converted by the caller's copy), the same on every
        member. int8 dequantizes the holders' terms and sums them in fp32 in the group's rank order."""
        start = time.perf_counter()
        for handle in bucket.handles:
            handle.wait()
        self.comm_seconds += time.perf_counter() - start
        if bucket.flat is not None:
            return bucket.flat
        total = torch.zeros(bucket.payloads[0].numel(), dtype=torch.float32, device=bucket.payloads[0].device)
        for q, s in zip(bucket.payloads, bucket.scales, strict=True):  # the same sum everywhere
            total += dequantize_int8(q, s)
        return total

    def momentum(self, name: str) -> torch.Tensor:
        """The outer momentum buffer of parameter `name` (zeros before the first outer step)."""
        state = self.optimizer.state.get(self.anchors[name], {})
        buffer = state.get("momentum_buffer")
        return buffer if buffer is not None else torch.zeros_like(self.anchors[name])

    def state(self) -> dict[str, torch.Tensor]:
        """Checkpoint entries: "<name>.outer_momentum" per parameter (local shard) and "outer_round" (int64). The
        global parameters are the parameters themselves at a round's end (the outer step just set them); with
        streamed fragments only the last fragment's are, and with merge_alpha > 0 none are, so "<name>.outer_anchor"
        then holds each one's. Refused while an exchange is in flight (`flush` first)."""
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} outer exchange(s) in flight: finish them before a checkpoint")
        out = {f"{name}{MOMENTUM_SUFFIX}": self.momentum(name).detach() for name in self.anchors}
        if self.saves_anchors:
            out.update({f"{name}{ANCHOR_SUFFIX}": anchor.detach() for name, anchor in self.anchors.items()})
        out[ROUND_KEY] = torch.tensor(self.round, dtype=torch.int64)
        return out

    def load(self, momenta: dict[str, torch.Tensor], round_index: int,
             anchors: dict[str, torch.Tensor] | None = None) -> None:
        """Resume: the anchors from `anchors` (local shards) where given, else from the parameters as they are now
        (loaded), the momentum buffers from `momenta` (local shards; a zero buffer is what torch's first step
        would start from), the round count."""
        anchors = anchors or {}
        with torch.no_grad():
            for name, (_, param) in self.params.items():
                self.anchors[name].copy_(anchors.get(name, param.detach()))
                self.optimizer.state[self.anchors[name]] = {"momentum_buffer": momenta[name].clone()}
        self.round = round_index

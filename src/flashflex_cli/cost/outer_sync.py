"""The cost of a round of low-communication training (a plan with `outer_sync`, semantics/outer_sync.py).

A round: every replica group runs its inner steps (each group costed by `estimate` as the synchronous plan of its
own pipelines and batch: `group_plan`), then the outer all-reduce of the pseudo-gradients in the compression
dtype, among the holders of every parameter slice across all groups (the runtime's outer buckets, one per holder
set, issued one after another: they share the slow links, so their times add), flat rings over their slowest link
at `dp_comm_efficiency` (int8: an all-gather of payloads and scales, charged as the all-reduce of the same ring time,
semantics/outer_sync.exchange_bytes). Streamed fragments (`fragments` > 1) overlap the all-reduce with the next inner steps: only
what exceeds the round's compute is exposed. The whole model's exchange (`fragments` 1) overlapped with
`overlap_steps` tau inner steps exposes what exceeds tau steps of the slowest group (the one whose inner steps make
the round's inner part). The outer optimizer's update (a few passes over the parameters) is
not charged: at memory bandwidth it is well under a millisecond per 100 M parameters.

`cross_bytes` (and `boundary_bytes` for pipeline transfers): the bytes a collective schedule puts on the links
between sites (parts of the fleet joined by slow
links): a ring all-reduce of B bytes among n ranks sends 2 (n-1)/n B over each hop, and the hops that join two
ranks of different sites cross a slow link (ring order: the ranks sorted, as gloo and NCCL build it for a group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..hardware.cluster import Cluster
from ..plan.schema import Plan
from ..semantics.outer_sync import (
    exchange_bytes,
    group_inner_steps,
    group_pipelines,
    group_round_sequences,
    group_sequences,
)
from ..semantics.process_groups import outer_slice_holders, rank_devices, slice_holders
from .comm import transfer_element_bytes
from .dp import ring_bucket_time
from .estimate import Estimate, estimate
from .params import CostParams
from .view import view

GRADIENT_WIRE = "fp32"  # the synchronous reduction's gradient elements (runtime/parallel/grad_sync.py)


def group_plan(plan: Plan, group: int) -> Plan:
    """The synchronous plan of one replica group: its pipelines, its batch per inner step, no prediction."""
    pipes = [plan.pipelines[p] for p in group_pipelines(plan)[group]]
    train = plan.inputs.train.model_copy(update={"global_batch": group_sequences(plan, group)})
    inputs = plan.inputs.model_copy(update={"train": train})
    return Plan(inputs=inputs, pipelines=pipes)


@dataclass(frozen=True)
class RoundEstimate:
    """One round, SI units: each group's inner step (s) and inner steps; the inner part of the round (the slowest
    group's steps, s), the outer all-reduce (s) and what of it is exposed (s), the round (s), its tokens, tokens/s,
    MFU over the devices used, and the pseudo-gradient bytes per round all ranks send."""

    group_step_s: list[float]
    group_steps: list[int]
    inner_s: float
    outer_s: float
    outer_exposed_s: float
    round_s: float
    round_tokens: int
    tokens_per_s: float
    mfu: float
    peak_flops_used: float
    fits: bool
    problems: list[str]
    outer_bytes: float
    groups: list[Estimate]

    def to_predicted(self, base: dict[str, Any]) -> dict[str, Any]:
        """The plan's `predicted` section: `base` (the groups' stages and pipelines, in plan order) with the
        round's figures; `iteration_time_s` is a round's time per step of the longest-stepping group."""
        steps = max(self.group_steps)
        out = dict(base)
        out.update({"iteration_time_s": _r(self.round_s / steps), "tokens_per_s": _r(self.tokens_per_s),
                    "mfu": _r(self.mfu), "fits": self.fits, "problems": list(self.problems),
                    "peak_flops_used": _r(self.peak_flops_used),
                    "outer_sync": {"round_s": _r(self.round_s), "inner_s": _r(self.inner_s),
                                   "outer_allreduce_s": _r(self.outer_s),
                                   "outer_exposed_s": _r(self.outer_exposed_s),
                                   "group_step_s": [_r(t) for t in self.group_step_s],
                                   "round_tokens": self.round_tokens,
                                   "outer_bytes_per_round": _r(self.outer_bytes)}})
        return out


def _r(value: float) -> float:
    return float(f"{value:.6g}")


def outer_allreduce_s(plan: Plan, cluster: Cluster, params: CostParams) -> tuple[float, float]:
    """(seconds of the outer all-reduce, bytes all ranks send in it) of a plan with `outer_sync`."""
    assert plan.outer_sync is not None
    compression = plan.outer_sync.compression
    devices = rank_devices(plan)
    per_set: dict[tuple[int, ...], int] = {}
    for sl in outer_slice_holders(plan):
        if sl.needs_reduce:
            per_set[sl.ranks] = per_set.get(sl.ranks, 0) + _elements(plan, sl)
    flat = replace(params, dp_hierarchical=False)  # the outer step's all-reduce is one flat ring
    cv = view(cluster)
    seconds = sent = 0.0
    for members, elements in sorted(per_set.items()):
        ring = [devices[r] for r in members]
        nbytes = exchange_bytes(elements, compression, len(members))
        time = ring_bucket_time(cluster, ring, [cv.info(d).node for d in ring], 1, nbytes, flat)
        seconds += time.inside_s + time.across_s
        sent += 2 * (len(members) - 1) * nbytes
    return seconds, sent


def _elements(plan: Plan, sl: Any) -> int:
    """Elements of one finest slice."""
    from ..semantics.parameters import model_params

    info = next(i for i in model_params(plan.inputs.model) if i.name == sl.name)
    total = 1
    for d, size in enumerate(info.shape):
        total *= (sl.stop - sl.start) if d == sl.dim else size
    return total


def round_estimate(plan: Plan, cluster: Cluster, params: CostParams | None = None) -> RoundEstimate:
    """Predict one round of `plan` (which has `outer_sync`) on `cluster`."""
    assert plan.outer_sync is not None
    params = params or CostParams()
    groups = [estimate(group_plan(plan, g), cluster, params) for g in range(len(plan.outer_sync.groups))]
    steps = group_inner_steps(plan)
    inner = max(e.iteration_time_s * h for e, h in zip(groups, steps, strict=True))
    outer, sent = outer_allreduce_s(plan, cluster, params)
    if plan.outer_sync.fragments > 1:
        hidden = inner
    else:  # tau steps of the slowest group (module docstring); 0 without overlap
        slowest = max(range(len(groups)), key=lambda g: groups[g].iteration_time_s * steps[g])
        hidden = plan.outer_sync.overlap_steps * groups[slowest].iteration_time_s
    exposed = max(0.0, outer - hidden)
    round_s = inner + exposed
    tokens = sum(group_round_sequences(plan)) * plan.inputs.train.seq_len
    tokens_per_s = tokens / round_s if round_s > 0 else 0.0
    peak = sum(e.peak_flops_used for e in groups)
    mfpt = groups[0].model_flops_per_token
    problems = [f"group {g}: {p}" for g, e in enumerate(groups) for p in e.problems]
    return RoundEstimate([e.iteration_time_s for e in groups], steps, inner, outer, exposed, round_s, tokens,
                         tokens_per_s, mfpt * tokens_per_s / peak if peak > 0 else 0.0, peak, not problems, problems,
                         sent, groups)


def round_predicted(plan: Plan, cluster: Cluster, params: CostParams | None = None) -> dict[str, Any]:
    """The `predicted` section of a plan of replica groups: its round's figures over the groups' stages and
    pipelines (renumbered in plan order)."""
    rounded = round_estimate(plan, cluster, params)
    stages: list[dict[str, Any]] = []
    pipes: list[dict[str, Any]] = []
    for est in rounded.groups:
        predicted = est.to_predicted()
        stages += [{**stage, "pipeline": stage["pipeline"] + len(pipes)} for stage in predicted["stages"]]
        pipes += predicted["pipelines"]
    base = {"model_flops_per_token": rounded.groups[0].model_flops_per_token,
            "dp_exposed_s": max(e.dp_exposed_s for e in rounded.groups),
            "optimizer_s": max(e.optimizer_s for e in rounded.groups), "pipelines": pipes, "stages": stages}
    return rounded.to_predicted(base)


def cross_bytes(slices: Sequence[Any], wire: str, rank_site: Sequence[int], plan: Plan) -> float:
    """Bytes the ring reductions of `slices` (those needing a reduction, grouped by holder set) put on links
    between sites, `rank_site[r]` the site of rank r (module docstring), in the wire format `wire` (fp32, bf16:
    all-reduced; int8: all-gathered with its scales, semantics/outer_sync.exchange_bytes)."""
    per_set: dict[tuple[int, ...], int] = {}
    for sl in slices:
        if sl.needs_reduce:
            per_set[sl.ranks] = per_set.get(sl.ranks, 0) + _elements(plan, sl)
    total = 0.0
    for members, elements in per_set.items():
        n = len(members)
        crossings = sum(1 for i in range(n) if rank_site[members[i]] != rank_site[members[(i + 1) % n]])
        total += crossings * 2 * (n - 1) / n * exchange_bytes(elements, wire, n)
    return total


def boundary_bytes(plan: Plan, rank_site: Sequence[int]) -> float:
    """Bytes per step the pipelines' stage boundaries put on links between sites: every micro-batch's activation
    forward and its gradient backward, [micro_batch, seq_len, hidden] in the transfer dtype."""
    train, hidden = plan.inputs.train, plan.inputs.model.hidden_size
    element = transfer_element_bytes(train)
    total, rank = 0.0, 0
    for pipe in plan.pipelines:
        firsts = []
        for stage in pipe.stages:
            firsts.append(rank)
            rank += stage.tp
        for a, b in zip(firsts[:-1], firsts[1:], strict=True):
            if rank_site[a] != rank_site[b]:
                total += 2 * pipe.sequences * train.seq_len * hidden * element
    return total


def cross_bytes_per_token(plan: Plan, rank_site: Sequence[int]) -> float:
    """Bytes per trained token on links between sites: a synchronous plan's gradient reduction (fp32), or a plan
    of replica groups' inner reductions per step plus its outer all-reduce per round."""
    seq_len = plan.inputs.train.seq_len
    if plan.outer_sync is None:
        step = cross_bytes(slice_holders(plan), GRADIENT_WIRE, rank_site, plan) + boundary_bytes(plan, rank_site)
        return step / (plan.inputs.train.global_batch * seq_len)
    # per step of every group
    inner = cross_bytes(slice_holders(plan), GRADIENT_WIRE, rank_site, plan) + boundary_bytes(plan, rank_site)
    outer = cross_bytes(outer_slice_holders(plan), plan.outer_sync.compression, rank_site, plan)
    steps = max(group_inner_steps(plan))
    return (inner * steps + outer) / (sum(group_round_sequences(plan)) * seq_len)

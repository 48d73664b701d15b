"""Data-parallel gradient reduction across pipelines whose stages hold the same layers.

The layer axis is cut at every stage boundary of every pipeline; inside one segment each pipeline holds
the segment in exactly one stage (its "holder"). The segment's gradient is all-reduced among the P
holders as a ring (one ring per TP slice, in parallel):
  volume per ring = segment parameters / min holder TP x grad_reduce_bytes  (the smaller-TP holder's
  larger shard sets the volume);
  hop = the slowest link of the ring through the holders' first devices, in pipeline order.
When that ring crosses nodes, the TP slices' rings share the nodes' NICs, so the volume on the slowest
hop is the whole segment gradient (x min TP). Embedding (first stages) and head (last stages) gradients
are reduced the same way (a tied embedding: among the first and the last stages together). A stage's DP time is the sum of the rings it takes part in (its devices run
them one after another), or, when larger, the summed time of all rings crossing the NIC of a node its
devices sit on (a NIC is one shared channel); it may start once every holder it shares a segment with
has finished its last backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware.cluster import Cluster
from ..model import flops as F
from ..plan.schema import Plan
from .comm import ring_allreduce_seconds
from .params import CostParams
from .view import view

StageKey = tuple[int, int]


@dataclass(frozen=True)
class DPResult:
    """stage_seconds[(p, s)]: DP reduction time of that stage (s); partners[(p, s)]: the stages it
    reduces with (its reductions start when all of them have finished their backward)."""

    stage_seconds: dict[StageKey, float]
    partners: dict[StageKey, tuple[StageKey, ...]]


def _ring_seconds(plan: Plan, cluster: Cluster, holders: list[StageKey], param_count: float,
                  params: CostParams) -> tuple[float, set[str]]:
    """One ring all-reduce of `param_count` parameters' gradients among the holder stages: its seconds,
    and the nodes whose NIC it uses (empty when it stays inside one node)."""
    cv = view(cluster)
    stages = [plan.pipelines[p].stages[s] for p, s in holders]
    min_tp = min(st.tp for st in stages)
    firsts = [st.devices[0] for st in stages]
    bandwidth, latency, crosses = float("inf"), 0.0, False
    for i, a in enumerate(firsts):
        b = firsts[(i + 1) % len(firsts)]
        link = cv.link(a, b)
        bandwidth = min(bandwidth, link.bandwidth)
        latency = max(latency, link.latency_s)
        crosses = crosses or cv.info(a).node != cv.info(b).node
    grad_bytes = params.grad_reduce_bytes
    volume = param_count / min_tp * grad_bytes * (min_tp if crosses else 1)
    nodes = {cv.info(d).node for d in firsts} if crosses else set()
    return ring_allreduce_seconds(len(holders), volume, bandwidth * params.dp_comm_efficiency, latency), nodes


def dp_reduction(plan: Plan, cluster: Cluster, params: CostParams) -> DPResult:
    """DP reduction time per stage for `plan` (no entries when no stages share a parameter: one pipeline, and
    no tied embedding held by both its first and last stage)."""
    seconds: dict[StageKey, float] = {}
    partners: dict[StageKey, set[StageKey]] = {}
    model = plan.inputs.model
    tied_ends = model.tie_embeddings and any(len(pipe.stages) > 1 for pipe in plan.pipelines)
    if len(plan.pipelines) < 2 and not tied_ends:
        return DPResult({}, {})
    cuts = sorted({b for pipe in plan.pipelines for st in pipe.stages for b in st.layers})
    segments: list[tuple[list[StageKey], float]] = []
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        holders = []
        for p, pipe in enumerate(plan.pipelines):
            for s, st in enumerate(pipe.stages):
                if st.layers[0] <= lo < st.layers[1]:
                    holders.append((p, s))
                    break
        segments.append((holders, (hi - lo) * F.layer_params(model)))
    lasts = [(p, len(pipe.stages) - 1) for p, pipe in enumerate(plan.pipelines)]
    if model.tie_embeddings:  # the last stages' copies of the embedding reduce with the first stages'
        segments.append(([(p, 0) for p in range(len(plan.pipelines))] + [k for k in lasts if k[1] > 0],
                         F.embedding_params(model)))
        segments.append((lasts, model.hidden_size))  # the final norm
    else:
        segments.append(([(p, 0) for p in range(len(plan.pipelines))], F.embedding_params(model)))
        segments.append((lasts, F.head_params(model)))
    nic_load: dict[str, float] = {}
    for holders, count in segments:
        if len(holders) < 2:
            continue
        t, nodes = _ring_seconds(plan, cluster, holders, count, params)
        for key in holders:
            seconds[key] = seconds.get(key, 0.0) + t
            partners.setdefault(key, set()).update(h for h in holders if h != key)
        for node in nodes:
            nic_load[node] = nic_load.get(node, 0.0) + t
    # A NIC is one shared channel: rings of different stages that cross the same node's NIC queue up.
    cv = view(cluster)
    for key in seconds:
        st = plan.pipelines[key[0]].stages[key[1]]
        busiest = max(nic_load.get(cv.info(d).node, 0.0) for d in st.devices)
        seconds[key] = max(seconds[key], busiest)
    return DPResult(seconds, {k: tuple(sorted(v)) for k, v in partners.items()})

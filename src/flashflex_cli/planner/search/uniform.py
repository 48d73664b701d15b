"""The `uniform` baseline: the best symmetric Megatron-style DP x PP x TP layout over the same devices.

What a homogeneous framework would run: one TP degree everywhere, PP stages with layers split as
equally as possible, equal micro-batches per pipeline, devices taken in node order and ranks laid out
TP-innermost, then DP, then PP (Megatron-LM's default order), so rank r sits in TP group r // tp,
replica (r // tp) % dp and stage r // (tp * dp). A TP degree must divide every node's device count
(groups never straddle a node). When dp * pp * tp does not use every device, the first ones in node
order are used, the rest stay idle. Candidates are prefiltered by memory and the fast model and the
best few are ranked by `cost.estimate.estimate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...cost.comm import ring_allreduce_seconds
from ...cost.estimate import estimate
from ...cost.schedule import closed_form_s, fill_s, stage_pass_s
from ...errors import InfeasibleError
from ...plan.schema import PipelinePlan, Plan, PlanInputs, StagePlan, UnusedDevice
from ..scoring.cost_cache import CostCache, Devs
from ..space.tp_groups import tp_degrees

KEEP = 6


@dataclass(frozen=True)
class UniformLayout:
    """One symmetric layout: `pipelines[d][s]` is replica d's stage s; `score_s` the fast estimate."""

    tp: int
    pp: int
    dp: int
    pipelines: tuple[tuple[Devs, ...], ...]
    score_s: float


def equal_layers(num_layers: int, stages: int) -> list[int]:
    """Layers per stage as equal as possible; the earlier stages take the remainder."""
    q, r = divmod(num_layers, stages)
    return [q + (1 if s < r else 0) for s in range(stages)]


def _layout(groups: list[Devs], pp: int, dp: int) -> tuple[tuple[Devs, ...], ...]:
    """Replica d's stage s is TP group s * dp + d of `groups` (every TP group of the degree, in device order)."""
    return tuple(tuple(groups[s * dp + d] for s in range(pp)) for d in range(dp))


def _fast_score(cache: CostCache, pipes: tuple[tuple[Devs, ...], ...], micro: int) -> float | None:
    layers = equal_layers(cache.model.num_layers, len(pipes[0]))
    slowest, shard = 0.0, 0.0
    count = len(pipes[0])
    for stages in pipes:
        times = []
        for s, devs in enumerate(stages):
            first, last = s == 0, s == count - 1
            if cache.max_layers(len(devs), first, last, count - s, cache.capacity(devs)) < layers[s]:
                return None
            cost = cache.stage(devs)
            times.append(stage_pass_s(layers[s], cost.layer_s, cost.embed_s, cost.head_s, first, last))
            shard = max(shard, layers[s] * cache.layer_grad_bytes / len(devs))
        links = [cache.p2p(stages[s], stages[s + 1]) for s in range(count - 1)]
        # the slowest stage as the period: a cheap prefilter, `estimate` ranks the layouts kept
        slowest = max(slowest, closed_form_s(max(times), fill_s(times, links), micro))
    dp = len(pipes)
    if dp > 1:
        g = cache.graph
        bw = min(float(g.node_bw[int(g.node[a[0][0]]), int(g.node[b[0][0]])]) for a in pipes for b in pipes
                 if a is not b) if dp <= 16 else float(g.node_bw.min())
        slowest += ring_allreduce_seconds(dp, shard, bw, 0.0)
    return slowest


def uniform_layouts(cache: CostCache, total_micro: int) -> list[UniformLayout]:
    """Every memory-feasible symmetric layout worth estimating, best fast score first."""
    g = cache.graph
    sizes = [len(node.devices) for node in g.cluster.nodes]
    common = math.gcd(*sizes)
    layers = cache.model.num_layers
    out: list[UniformLayout] = []
    for tp in tp_degrees(cache.model, common):
        if common % tp:
            continue
        groups = [tuple(range(r, r + tp)) for r in range(0, g.size - tp + 1, tp)]
        for pp in range(1, min(layers, g.size // tp) + 1):
            room = g.size // (tp * pp)
            dps = [d for d in range(room, 0, -1) if total_micro % d == 0 and total_micro // d >= pp][:3]
            for dp in dps:
                pipes = _layout(groups, pp, dp)
                fast = _fast_score(cache, pipes, total_micro // dp)
                if fast is not None:
                    out.append(UniformLayout(tp, pp, dp, pipes, fast))
    return sorted(out, key=lambda u: (u.score_s, u.tp, u.pp, u.dp))


def uniform_plan(cache: CostCache, layout: UniformLayout, total_micro: int, seed: int) -> Plan:
    """The Plan of a symmetric layout (equal layers per stage, equal micro-batches per replica)."""
    g, train = cache.graph, cache.train
    layers = equal_layers(cache.model.num_layers, layout.pp)
    pipelines = []
    for stages in layout.pipelines:
        start, plans = 0, []
        for devs, n in zip(stages, layers, strict=True):
            plans.append(StagePlan(devices=[g.ids[i] for i in devs], tp=layout.tp, layers=(start, start + n)))
            start += n
        pipelines.append(PipelinePlan(micro_batch_size=cache.micro_batch,
                                      num_micro_batches=total_micro // layout.dp, stages=plans))
    used = layout.tp * layout.pp * layout.dp
    idle = [UnusedDevice(device=g.ids[i], reason=f"uniform layout {layout.dp}x{layout.pp}x{layout.tp} "
                         f"(DP x PP x TP) uses {used} of {g.size} devices") for i in range(used, g.size)]
    inputs = PlanInputs(cluster_sha256=g.cluster.sha256(), cluster_name=g.cluster.name, model=cache.model,
                        train=train, strategy="uniform", seed=seed)
    return Plan(inputs=inputs, pipelines=pipelines, unused_devices=idle)


def best_uniform(cache: CostCache, total_micro: int, seed: int) -> Plan:
    """The best symmetric layout by `estimate`; InfeasibleError when none fits."""
    best: tuple[float, int, Plan] | None = None
    for index, layout in enumerate(uniform_layouts(cache, total_micro)[:KEEP]):
        plan = uniform_plan(cache, layout, total_micro, seed)
        est = estimate(plan, cache.graph.cluster, cache.params)
        if est.fits and (best is None or (est.iteration_time_s, index) < best[:2]):
            best = (est.iteration_time_s, index, plan.model_copy(update={"predicted": est.prediction()}))
    if best is None:
        raise InfeasibleError(
            f"no symmetric DP x PP x TP layout of {cache.model.name} fits on these {cache.graph.size} devices "
            f"with {total_micro} micro-batches (TP must divide every node's device count)"
        )
    return best[2]

"""A candidate layout: pipelines with their layer splits, a batch split, and the fast score.

The fast score approximates the iteration time (seconds): the slowest pipeline under its micro-batch
share (`batch.split_batch`) plus the data-parallel reduction of the slowest stage, computed per layer
the way cost/dp.py does (vectorised over pipelines and layers). Candidates are ranked by this score; the finalists are then
built as `Plan`s and ranked by `cost.estimate.estimate` alone (the single source of truth).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..cost.estimate import estimate
from ..plan.schema import PipelinePlan, Plan, PlanInputs, StagePlan, UnusedDevice
from .batch import pipeline_time, split_batch
from .fastcost import CostCache
from .pipeline import PipeEval


@dataclass(frozen=True)
class Candidate:
    """Pipelines (in canonical order), their micro-batch counts, and the fast score in seconds."""

    pipes: tuple[PipeEval, ...]
    micro: tuple[int, ...]
    score_s: float

    @cached_property
    def used(self) -> frozenset[int]:
        """Device indices the candidate uses."""
        return frozenset(i for pipe in self.pipes for i in pipe.devices)

    def signature(self) -> tuple:
        """Canonical identity of the layout (for de-duplication and deterministic tie-breaks)."""
        return tuple((pipe.stages, pipe.counts, m) for pipe, m in zip(self.pipes, self.micro, strict=True))


def _rings(cache: CostCache, firsts: np.ndarray, tps: np.ndarray, nbytes: float,
           nic_load: np.ndarray) -> np.ndarray:
    """Seconds of one ring all-reduce per column: rings run through `firsts[:, c]` (devices, pipeline order).

    Volume per ring: `nbytes` / min TP, times min TP when the ring crosses nodes (TP slices share a NIC).
    A ring that crosses nodes adds its time to `nic_load` of every node it touches (indexed by node).
    """
    g = cache.graph
    count = firsts.shape[0]
    nodes = g.node[firsts]
    nxt = np.concatenate([nodes[1:], nodes[:1]])
    bw = g.node_bw[nodes, nxt].min(axis=0) * cache.params.dp_comm_efficiency
    crosses = (nodes != nxt).any(axis=0)
    min_tp = tps.min(axis=0)
    volume = nbytes / min_tp * np.where(crosses, min_tp, 1)
    seconds = 2.0 * (count - 1) / count * volume / bw
    if crosses.any():
        ordered = np.sort(nodes[:, crosses], axis=0)
        first = np.ones(ordered.shape, dtype=bool)
        first[1:] = ordered[1:] != ordered[:-1]
        weights = np.repeat(seconds[crosses][None, :], count, axis=0)
        nic_load += np.bincount(ordered[first], weights=weights[first], minlength=len(nic_load))
    return seconds


def dp_time(cache: CostCache, pipes: tuple[PipeEval, ...]) -> float:
    """Seconds of the data-parallel gradient reduction of the slowest stage (module docstring).

    As cost/dp.py: every layer's gradient is ring-reduced among the stages holding it (one per
    pipeline), through their first devices in pipeline order; a stage's time is the sum over its layers,
    plus the embedding (first stages) and head (last stages) rings, or the load of its node's NIC (every
    ring crossing that node queues there) when larger.
    """
    count = len(pipes)
    if count < 2:
        return 0.0
    g = cache.graph
    layers = cache.model.num_layers
    firsts = np.empty((count, layers), dtype=np.int64)
    tps = np.empty((count, layers), dtype=np.int64)
    owner = np.empty((count, layers), dtype=np.int64)
    for p, pipe in enumerate(pipes):
        counts = np.asarray(pipe.counts)
        owner[p] = np.repeat(np.arange(len(counts)), counts)
        firsts[p] = np.repeat([st[0] for st in pipe.stages], counts)
        tps[p] = np.repeat([len(st) for st in pipe.stages], counts)
    nic_load = np.zeros(len(g.cluster.nodes))
    per_layer = _rings(cache, firsts, tps, cache.layer_grad_bytes, nic_load)
    ends = np.array([[pipe.stages[0][0]] for pipe in pipes]), np.array([[pipe.stages[-1][0]] for pipe in pipes])
    end_tps = np.array([[len(pipe.stages[0])] for pipe in pipes]), np.array([[len(pipe.stages[-1])] for pipe in pipes])
    embed_s = float(_rings(cache, ends[0], end_tps[0], cache.embed_grad_bytes, nic_load)[0])
    head_s = float(_rings(cache, ends[1], end_tps[1], cache.head_grad_bytes, nic_load)[0])
    worst = 0.0
    for p, pipe in enumerate(pipes):
        sums = np.bincount(owner[p], weights=per_layer, minlength=pipe.num_stages)
        sums[0] += embed_s
        sums[-1] += head_s
        busiest = nic_load[g.node[[st[0] for st in pipe.stages]]]
        worst = max(worst, float(np.maximum(sums, busiest).max()))
    return worst


def score(cache: CostCache, pipes: list[PipeEval] | tuple[PipeEval, ...], total_micro: int) -> Candidate | None:
    """Batch-split `pipes` and score them; None when a pipeline does not fit or the batch is too small."""
    if not pipes or not all(pipe.ok for pipe in pipes):
        return None
    ordered = tuple(sorted(pipes, key=lambda pipe: min(pipe.devices)))
    micro = split_batch(total_micro, [p.pace_s for p in ordered], [p.fill_s - p.pace_s for p in ordered],
                        [p.num_stages for p in ordered])
    if micro is None:
        return None
    slowest = max(pipeline_time(p.pace_s, p.fill_s, m) for p, m in zip(ordered, micro, strict=True))
    return Candidate(ordered, tuple(micro), slowest + dp_time(cache, ordered))


def build_plan(cache: CostCache, cand: Candidate, strategy: str, seed: int,
               unused: dict[str, str] | None = None, predict: bool = True) -> Plan:
    """The `Plan` of a candidate, with `predicted` from the cost model's `estimate`."""
    g, train, model = cache.graph, cache.train, cache.model
    pipelines = []
    for pipe, micro in zip(cand.pipes, cand.micro, strict=True):
        start, stages = 0, []
        for devs, n in zip(pipe.stages, pipe.counts, strict=True):
            stages.append(StagePlan(devices=[g.ids[i] for i in devs], tp=len(devs), layers=(start, start + n)))
            start += n
        pipelines.append(PipelinePlan(micro_batch_size=train.micro_batch_size, num_micro_batches=micro,
                                      stages=stages))
    used = cand.used
    reasons = unused or {}
    idle = [UnusedDevice(device=g.ids[i], reason=reasons.get(g.ids[i], "the fastest plan found leaves it idle"))
            for i in range(g.size) if i not in used]
    inputs = PlanInputs(cluster_sha256=g.cluster.sha256(), cluster_name=g.cluster.name, model=model, train=train,
                        strategy=strategy, seed=seed)
    plan = Plan(inputs=inputs, pipelines=pipelines, unused_devices=idle)
    if predict:
        plan = plan.model_copy(update={"predicted": estimate(plan, g.cluster, cache.params).to_predicted()})
    return plan

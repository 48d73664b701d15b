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
    """Pipelines (in canonical order), their micro-batch counts, the fast score in seconds, and each
    pipeline's micro-batch size in sequences (None: the training configuration's, for every pipeline)."""

    pipes: tuple[PipeEval, ...]
    micro: tuple[int, ...]
    score_s: float
    mbs: tuple[int, ...] | None = None

    @cached_property
    def used(self) -> frozenset[int]:
        """Device indices the candidate uses."""
        return frozenset(i for pipe in self.pipes for i in pipe.devices)

    def signature(self) -> tuple:
        """Canonical identity of the layout (for de-duplication and deterministic tie-breaks)."""
        base = tuple((pipe.stages, pipe.counts, m) for pipe, m in zip(self.pipes, self.micro, strict=True))
        return base if self.mbs is None else (*base, self.mbs)


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


def _rows(cache: CostCache, pipe: PipeEval) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per layer of one pipeline: its stage's first device, TP degree and stage index (int64 [L] each), and
    every stage's first device (int64 [S]); memoised on the cache by (stages, counts)."""
    key = (pipe.stages, pipe.counts)
    hit = cache.dp_rows.get(key)
    if hit is None:
        counts = np.asarray(pipe.counts)
        heads = np.array([st[0] for st in pipe.stages], dtype=np.int64)
        hit = (np.repeat(heads, counts), np.repeat(np.array([len(st) for st in pipe.stages], dtype=np.int64), counts),
               np.repeat(np.arange(len(counts), dtype=np.int64), counts), heads)
        cache.dp_rows[key] = hit
    return hit


def dp_time(cache: CostCache, pipes: tuple[PipeEval, ...]) -> float:
    """Seconds of the data-parallel gradient reduction of the slowest stage (module docstring).

    As cost/dp.py: every layer's gradient is ring-reduced among the stages holding it (one per
    pipeline), through their first devices in pipeline order; a stage's time is the sum over its layers,
    plus the embedding (first stages) and head (last stages) rings, or the load of its node's NIC (every
    ring crossing that node queues there) when larger. Vectorised over pipelines and layers; every stage's
    sum adds its layers in layer order, as a per-pipeline `np.bincount` would.
    """
    count = len(pipes)
    if count < 2:
        return 0.0
    g = cache.graph
    rows = [_rows(cache, pipe) for pipe in pipes]
    firsts = np.stack([r[0] for r in rows])
    tps = np.stack([r[1] for r in rows])
    stages = np.array([len(r[3]) for r in rows], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(stages)[:-1]])
    owner = np.stack([r[2] for r in rows]) + offsets[:, None]
    heads = np.concatenate([r[3] for r in rows])
    nic_load = np.zeros(len(g.cluster.nodes))
    per_layer = _rings(cache, firsts, tps, cache.layer_grad_bytes, nic_load)
    ends = np.array([[pipe.stages[0][0]] for pipe in pipes]), np.array([[pipe.stages[-1][0]] for pipe in pipes])
    end_tps = np.array([[len(pipe.stages[0])] for pipe in pipes]), np.array([[len(pipe.stages[-1])] for pipe in pipes])
    embed_s = float(_rings(cache, ends[0], end_tps[0], cache.embed_grad_bytes, nic_load)[0])
    head_s = float(_rings(cache, ends[1], end_tps[1], cache.head_grad_bytes, nic_load)[0])
    sums = np.bincount(owner.ravel(), weights=np.tile(per_layer, count), minlength=len(heads))
    sums[offsets] += embed_s
    sums[offsets + stages - 1] += head_s
    busiest = nic_load[g.node[heads]]
    return float(np.maximum(sums, busiest).max())


def score(cache: CostCache, pipes: list[PipeEval] | tuple[PipeEval, ...], total_micro: int,
          bound: float = float("inf")) -> Candidate | None:
    """Batch-split `pipes` and score them; None when a pipeline does not fit or the batch is too small, or
    when the slowest pipeline alone already takes `bound` seconds or more (the score can only be larger, so
    the data-parallel term is not computed)."""
    if not pipes or not all(pipe.ok for pipe in pipes):
        return None
    ordered = tuple(sorted(pipes, key=lambda pipe: min(pipe.devices)))
    micro = split_batch(total_micro, [p.pace_s for p in ordered], [p.fill_s - p.pace_s for p in ordered],
                        [p.num_stages for p in ordered])
    if micro is None:
        return None
    slowest = max(pipeline_time(p.pace_s, p.fill_s, m) for p, m in zip(ordered, micro, strict=True))
    if slowest >= bound:
        return None
    return Candidate(ordered, tuple(micro), slowest + dp_time(cache, ordered))


def build_plan(cache: CostCache, cand: Candidate, strategy: str, seed: int,
               unused: dict[str, str] | None = None, predict: bool = True) -> Plan:
    """The `Plan` of a candidate, with `predicted` from the cost model's `estimate`."""
    g, train, model = cache.graph, cache.train, cache.model
    pipelines = []
    sizes = cand.mbs or (train.micro_batch_size,) * len(cand.pipes)
    for pipe, micro, mbs in zip(cand.pipes, cand.micro, sizes, strict=True):
        start, stages = 0, []
        for devs, n in zip(pipe.stages, pipe.counts, strict=True):
            stages.append(StagePlan(devices=[g.ids[i] for i in devs], tp=len(devs), layers=(start, start + n)))
            start += n
        pipelines.append(PipelinePlan(micro_batch_size=mbs, num_micro_batches=micro, stages=stages))
    used = cand.used
    reasons = unused or {}
    idle = [UnusedDevice(device=g.ids[i], reason=reasons.get(g.ids[i], "the fastest plan found leaves it idle"))
            for i in range(g.size) if i not in used]
    inputs = PlanInputs(cluster_sha256=g.cluster_sha256, cluster_name=g.cluster.name, model=model, train=train,
                        strategy=strategy, seed=seed)
    plan = Plan(inputs=inputs, pipelines=pipelines, unused_devices=idle)
    if predict:
        plan = plan.model_copy(update={"predicted": estimate(plan, g.cluster, cache.params).to_predicted()})
    return plan

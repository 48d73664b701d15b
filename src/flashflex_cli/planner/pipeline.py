"""Evaluate one pipeline (an ordered list of TP groups) with the planner's fast model.

For stages s = 0..S-1 with TP groups `stages[s]` (device indices of the DeviceGraph):
per-layer time t_s and embedding / head time from the cost model, memory cap c_s for in_flight = S - s
micro-batches (1F1B: stage s keeps S - s micro-batches' activations alive, since every pipeline gets at
least S micro-batches), then the exact min-max layer split (`layers.split_layers`). The result gives
the pipeline's pace (seconds per micro-batch in steady state: the slowest stage, or, with transfer
latency, the slowest window of stages, see `window_pace`), its fill (sum of stage times plus a forward
and a backward transfer per hop) and its largest per-device gradient shard and largest per-stage
gradient (bytes), which the data-parallel term of the candidate score needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .fastcost import CostCache, Devs
from .layers import split_layers, stage_times


@dataclass(frozen=True)
class PipeEval:
    """A pipeline with its layer split; `ok` False when the layers cannot fit (counts empty then)."""

    stages: tuple[Devs, ...]
    counts: tuple[int, ...]
    pace_s: float
    fill_s: float
    shard_bytes: float
    ok: bool
    stage_grad_bytes: float = 0.0

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device of the pipeline in stage order."""
        return tuple(i for stage in self.stages for i in stage)


_INFEASIBLE = float("inf")


@lru_cache(maxsize=256)
def _windows(count: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(count)


def window_pace(times: list[float], links: list[float]) -> float:
    """Steady-state 1F1B period (seconds per micro-batch) with transfer latency, in closed form.

    In 1F1B, stage s runs F(i + w_s), B(i), F(i + w_s + 1), ... with w_s = S - s - 1. For any window of
    stages s..t, a micro-batch's forward entering s and its backward leaving s close a cycle through
    every stage and link of the window that spans t - s + 1 periods, so the period is at least
    (sum_{j=s..t} u_j + 2 sum_{j=s..t-1} p2p_j) / (t - s + 1), u_j = f_j + b_j. The maximum over all
    windows (one-stage windows give the slowest stage) is the period; we checked it against the cost
    model's event simulation (tests/test_planner_pipeline.py).
    """
    u = np.asarray(times, dtype=np.float64)
    c = np.concatenate([np.asarray(links, dtype=np.float64), [0.0]])
    # cost of window s..t = U[t+1] - U[s] + 2 (C[t] - C[s]) where C counts links s..t-1
    big_u = np.concatenate([[0.0], np.cumsum(u)])
    big_c = np.concatenate([[0.0], np.cumsum(c)])
    s_idx, t_idx = _windows(len(u))
    cost = big_u[t_idx + 1] - big_u[s_idx] + 2.0 * (big_c[t_idx] - big_c[s_idx])
    return float((cost / (t_idx - s_idx + 1)).max())


def evaluate_pipeline(cache: CostCache, stages: tuple[Devs, ...]) -> PipeEval:
    """Split layers over `stages` and return the pipeline's pace, fill and gradient shard size."""
    memo = cache.pipe_memo
    key = tuple(stages)
    hit = memo.get(key)
    if hit is not None:
        return hit
    # Pipelines of equal shape (equal node classes and local indices, equal links between stages) elsewhere
    # in the cluster cost the same: reuse the figures, with this pipeline's devices.
    g = cache.graph
    node_of, bw = g.node_list, g.node_bw_rows
    nodes = [node_of[st[0]] for st in stages]
    stage_key = cache.stage_key
    shape = (tuple([stage_key(st) for st in stages]),
             tuple([bw[a][b] if a != b else -1.0 for a, b in zip(nodes, nodes[1:], strict=False)]))
    same = cache.shape_memo.get(shape)
    if same is not None:
        hit = PipeEval(tuple(stages), same.counts, same.pace_s, same.fill_s, same.shard_bytes, same.ok,
                       same.stage_grad_bytes)
        memo[key] = hit
        return hit
    model = cache.model
    count = len(stages)
    per_layer, extra, caps = [], [], []
    terms = cache.stage_terms  # (layer_s, extra_s, cap) by (devs, first, last, in_flight), see below
    for s, devs in enumerate(stages):
        key = (devs, s == 0, s == count - 1, count - s)
        found = terms.get(key)
        if found is None:
            cost = cache.stage(devs)
            first, last = key[1], key[2]
            found = terms[key] = (cost.layer_s, (cost.embed_s if first else 0.0) + (cost.head_s if last else 0.0),
                                  cache.max_layers(len(devs), first, last, count - s, cache.capacity(devs)))
        per_layer.append(found[0])
        extra.append(found[1])
        caps.append(found[2])
    split = split_layers(per_layer, extra, caps, model.num_layers)
    if split is None:
        hit = PipeEval(tuple(stages), (), _INFEASIBLE, _INFEASIBLE, _INFEASIBLE, False)
    else:
        times = stage_times(per_layer, extra, split)
        links = [cache.p2p(stages[s], stages[s + 1]) for s in range(count - 1)]
        hops = 2 * sum(links)
        pace, fill = max(times), sum(times) + hops
        if count > 1 and hops > 0:
            pace = window_pace(times, links)
        shard, whole = 0.0, 0.0
        for s, devs in enumerate(stages):
            size = split[s] * cache.layer_grad_bytes
            if s == 0:
                size += cache.embed_grad_bytes
            if s == count - 1:
                size += cache.head_grad_bytes
            shard = max(shard, size / len(devs))
            whole = max(whole, size)
        hit = PipeEval(tuple(stages), tuple(split), pace, fill, shard, True, whole)
    memo[key] = hit
    cache.shape_memo[shape] = hit
    return hit

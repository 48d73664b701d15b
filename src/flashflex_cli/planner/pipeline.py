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

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache

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

    @cached_property
    def devices(self) -> tuple[int, ...]:
        """Every device of the pipeline in stage order."""
        return tuple(i for stage in self.stages for i in stage)

    @cached_property
    def first_device(self) -> int:
        """The pipeline's smallest device index (candidates order their pipelines by it)."""
        return min(min(stage) for stage in self.stages)


_INFEASIBLE = float("inf")


@lru_cache(maxsize=256)
def _windows(count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every window s <= t of `count` stages: s, t, t + 1 and its width t - s + 1 (float)."""
    s_idx, t_idx = np.triu_indices(count)
    return s_idx, t_idx, t_idx + 1, (t_idx - s_idx + 1).astype(np.float64)


def window_pace(times: list[float], links: list[float]) -> float:
    """Steady-state 1F1B period (seconds per micro-batch) with transfer latency, in closed form.

    In 1F1B, stage s runs F(i + w_s), B(i), F(i + w_s + 1), ... with w_s = S - s - 1. For any window of
    stages s..t, a micro-batch's forward entering s and its backward leaving s close a cycle through
    every stage and link of the window that spans t - s + 1 periods, so the period is at least
    (sum_{j=s..t} u_j + 2 sum_{j=s..t-1} p2p_j) / (t - s + 1), u_j = f_j + b_j. The maximum over all
    windows (one-stage windows give the slowest stage) is the period; we checked it against the cost
    model's event simulation (tests/test_planner_pipeline.py).
    """
    count = len(times)
    big_u = np.zeros(count + 1)
    big_c = np.zeros(count + 1)
    np.add.accumulate(times, out=big_u[1:])  # np.cumsum's sequential sums
    np.add.accumulate(links, out=big_c[1:count])
    # cost of window s..t = U[t+1] - U[s] + 2 (C[t] - C[s]) where C counts links s..t-1
    s_idx, t_idx, t_next, width = _windows(count)
    cost = big_u[t_next] - big_u[s_idx] + 2.0 * (big_c[t_idx] - big_c[s_idx])
    return float((cost / width).max())


def evaluate_pipeline(cache: CostCache, stages: tuple[Devs, ...],
                      links: Callable[[], list[float]] | None = None) -> PipeEval:
    """Split layers over `stages` and return the pipeline's pace, fill and gradient shard size. `links`: where
    the caller has them, the `CostCache.p2p` seconds between consecutive stages (called only when needed)."""
    found = _memoised(cache, stages)
    if isinstance(found, PipeEval):
        return found
    pipe = _finish(cache, stages, found, *_terms(cache, stages), links)
    assert pipe is not None
    return pipe


def evaluate_unless(cache: CostCache, stages: tuple[Devs, ...], links: Callable[[], list[float]],
                    skip: Callable[[float, float, int], bool],
                    terms: tuple[list[float], list[float], list[int]] | None = None) -> PipeEval | None:
    """`evaluate_pipeline`, or None (nothing memoised) when `skip(pace_low, fill, stages)` says so once the layer
    split is known: `fill` is the exact fill (seconds) and `pace_low` a lower bound on the pace (its slowest
    stage and adjacent pairs of stages, the windows of at most two stages of `window_pace`), so a caller that
    only wants pipelines below some cost learns early that this one is not (the window search is skipped).
    `terms`: `_terms(cache, stages)` where the caller has them."""
    hit = cache.pipe_memo.get(tuple(stages))
    if hit is not None:
        return hit  # type: ignore[return-value]
    # the shape memo is consulted only for a pipeline not skipped (the figures are the same either way)
    return _finish(cache, stages, None, *(terms or _terms(cache, stages)), links, skip)


def _memoised(cache: CostCache, stages: tuple[Devs, ...]) -> PipeEval | tuple:
    """The memoised evaluation of `stages` (by devices, else by shape), or the shape key to store it under."""
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
    return shape


def _terms(cache: CostCache, stages: tuple[Devs, ...]) -> tuple[list[float], list[float], list[int]]:
    """Per stage: one layer's seconds, the embedding / head seconds, and the layers that fit in memory."""
    count, end = len(stages), len(stages) - 1
    rows = []
    terms = cache.stage_terms  # (layer_s, extra_s, cap) by (devs, first, last, in_flight), see below
    get = terms.get
    for s, devs in enumerate(stages):
        found = get((devs, s == 0, s == end, count - s))
        if found is None:
            cost = cache.stage(devs)
            first, last = s == 0, s == end
            found = terms[(devs, first, last, count - s)] = (
                cost.layer_s, (cost.embed_s if first else 0.0) + (cost.head_s if last else 0.0),
                cache.max_layers(len(devs), first, last, count - s, cache.capacity(devs)))
        rows.append(found)
    return [row[0] for row in rows], [row[1] for row in rows], [row[2] for row in rows]


def _finish(cache: CostCache, stages: tuple[Devs, ...], shape: tuple | None, per_layer: list[float],
            extra: list[float], caps: list[int], known_links: Callable[[], list[float]] | None = None,
            skip: Callable[[float, float, int], bool] | None = None) -> PipeEval | None:
    """The layer split and figures of `stages` from its stage terms; memoised by devices and by `shape` (None:
    looked up first when not skipped, see `_memoised`); None, memoised nowhere, when `skip` says so (see
    `evaluate_unless`)."""
    count = len(stages)
    split = split_layers(per_layer, extra, caps, cache.model.num_layers)
    if split is not None:
        times = stage_times(per_layer, extra, split)
        links = known_links() if known_links is not None else \
            [cache.p2p(stages[s], stages[s + 1]) for s in range(count - 1)]
        hops = 2 * sum(links)
        pace, fill = max(times), sum(times) + hops
        if skip is not None:
            low = pace
            for s in range(count - 1):
                pair = (times[s] + times[s + 1] + 2.0 * links[s]) / 2.0
                if pair > low:
                    low = pair
            if skip(low, fill, count):
                return None
    if shape is None:
        found = _memoised(cache, stages)
        if isinstance(found, PipeEval):
            return found
        shape = found
    if split is None:
        hit = PipeEval(tuple(stages), (), _INFEASIBLE, _INFEASIBLE, _INFEASIBLE, False)
    else:
        if count > 1 and hops > 0:
            pace = window_pace(times, links)
        grad = cache.layer_grad_bytes
        sizes = [n * grad for n in split]
        sizes[0] += cache.embed_grad_bytes
        sizes[-1] += cache.head_grad_bytes
        shard = max(0.0, max([size / len(devs) for size, devs in zip(sizes, stages, strict=True)]))
        whole = max(0.0, max(sizes))
        hit = PipeEval(tuple(stages), tuple(split), pace, fill, shard, True, whole)
    cache.pipe_memo[tuple(stages)] = hit
    cache.shape_memo[shape] = hit
    return hit

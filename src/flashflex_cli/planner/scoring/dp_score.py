"""The fast score's data-parallel term: what cost/dp.py charges, memoised for thousands of candidates.

Every layer is held by one stage per pipeline; its gradient is all-reduced among those holders through their
first devices (pipeline order), flat or hierarchically, for the seconds `cost.dp.ring_bucket_time` gives.
Layers whose holders are the same stages form one segment and cost the same: durations are memoised per cache
(`DpMemo`) by the holders' nodes.

With `CostParams.dp_overlap` (the runtime's default) a layer's bucket starts when every holder has finished its
last backward through that layer: pipeline p ends its last backward at `ends[p]`, its stages end theirs at the
cost model's closed-form cool-down (`cost.schedule.drain_offsets_s`) and pass their layers as
`cost.dp.layers_ready_s` has it (head first on the last stage, embedding last on the first). Buckets run in the
runtime's order (head, layers top-down, embedding), each after the previous bucket where they share a holder (a
stage's buckets run one after another), their cross-node parts queued on the nodes' NICs (`cost.dp.NicQueue`).
The term is when the last bucket ends (at least the slowest pipeline's end). Without overlap every reduction
starts after the slowest pipeline, and the term is the longest sum of one stage's buckets or of one node's NIC
load (a bound of the cost model's sequential timeline: it leaves out waits between stages). A caller that only
wants terms below a bound (the refinement) first runs the timeline with the ready times of the pipelines whose
terms are memoised (`dp_finish_below`): a valid lower bound, so most losing trials never compute the others'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ...cost.dp import BucketTime, NicQueue, layer_ready_s, layers_ready_s, ring_bucket_time
from ...cost.schedule import drain_offsets_s, stage_pass_s
from .cost_cache import CostCache
from .pipeline_score import PipeEval

Column = BucketTime  # (inside_s, across_s, nodes: node indices whose NIC the across part uses)


class DpMemo:
    """One cache's data-parallel answers: each pipeline's `PipeTerms` (by (stages, counts), and by the evaluation
    object itself) and bucket columns (by the holders' first devices, and by their nodes)."""

    __slots__ = ("terms", "columns")

    def __init__(self) -> None:
        self.terms: dict[object, object] = {}
        self.columns: dict[tuple, Column] = {}


class PipeTerms(NamedTuple):
    """Per layer of one pipeline: `rows` its stage's first device, TP degree and stage index (int64 [3, L]);
    `ready` when its last backward has finished the layer (float [L], seconds before the end of that backward,
    <= 0); `head_s`: the same for the head (last stage; the embedding is ready at 0)."""

    rows: np.ndarray
    ready: np.ndarray
    head_s: float


def pipe_terms(cache: CostCache, pipe: PipeEval) -> PipeTerms:
    """`PipeTerms` of `pipe` with the times of `cache` (the one of its micro-batch size), memoised on the cache by
    (stages, counts), and by the object itself for the repeated questions about one evaluation."""
    memo = cache.memo(DpMemo).terms
    mine = memo.get(id(pipe))
    if mine is not None and mine[0] is pipe:  # the entry holds `pipe`, so its id is not reused meanwhile
        return mine[1]  # type: ignore[no-any-return]
    key = (pipe.stages, pipe.counts)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _terms(cache, pipe)
    memo[id(pipe)] = (pipe, hit)
    return hit  # type: ignore[return-value]


def _terms(cache: CostCache, pipe: PipeEval) -> PipeTerms:
    stages, last = pipe.stages, len(pipe.stages) - 1
    stage, p2p = cache.stage, cache.p2p
    times = [stage(devs) for devs in stages]
    wholes = [stage_pass_s(n, lt.bwd_s, lt.embed_bwd_s, lt.head_bwd_s, s == 0, s == last)
              for s, (lt, n) in enumerate(zip(times, pipe.counts, strict=True))]
    backs = [p2p(stages[s], stages[s - 1]) for s in range(1, last + 1)]
    starts = [end - whole for end, whole in zip(drain_offsets_s(wholes, backs), wholes, strict=True)]
    heads = [0.0] * last + [times[last].head_bwd_s]
    layers = [lt.bwd_s for lt in times]
    return PipeTerms(_rows(pipe), np.array(layers_ready_s(starts, heads, layers, pipe.counts)),
                     layer_ready_s(starts[last], heads[last], layers[last], 0))


def _rows(pipe: PipeEval) -> np.ndarray:
    """`PipeTerms.rows` of `pipe`: per layer its stage's first device, TP degree and stage index (int64 [3, L])."""
    stages = pipe.stages
    per_stage = np.array([[devs[0] for devs in stages], [len(devs) for devs in stages], range(len(stages))],
                         dtype=np.int64)
    return np.repeat(per_stage, pipe.counts, axis=1)


def _column(cache: CostCache, devices: Sequence[int], min_tp: int, nbytes: float) -> Column:
    """`cost.dp.ring_bucket_time` of one all-reduce of `nbytes` among holders whose first devices are `devices`
    (pipeline order; nodes keyed by index), memoised by the devices and by their nodes (holders on equal nodes
    cost the same)."""
    memo = cache.memo(DpMemo).columns
    exact = ("dev", tuple(devices), min_tp, nbytes)
    hit = memo.get(exact)
    if hit is not None:
        return hit
    node = cache.graph.node_list
    nodes = tuple([node[i] for i in devices])
    key = ("col", nodes, min_tp, nbytes)
    hit = memo.get(key)
    if hit is None:
        ids = cache.graph.ids
        hit = memo[key] = ring_bucket_time(cache.graph.cluster, [ids[i] for i in devices], nodes, min_tp, nbytes,
                                           cache.params)
    memo[exact] = hit
    return hit


NOTHING: Column = BucketTime(0.0, 0.0, frozenset())


class _Holders(NamedTuple):
    """Per layer of the pipelines of one candidate (k pipelines, L layers): `by_layer` the holders' first devices
    (pipeline order), `least` their smallest TP degree; per pair of layers l, l + 1 (L - 1 entries): `whole`
    whether every holder is the same, `shares` whether one is; `owner` every pipeline's stage index per layer
    (int64 [k, L])."""

    by_layer: list[list[int]]
    least: list[int]
    whole: list[bool]
    shares: list[bool]
    owner: np.ndarray


def _holders(terms: Sequence[PipeTerms]) -> _Holders:
    """The `_Holders` of the pipelines with `PipeTerms` `terms`."""
    rows = np.stack([t.rows for t in terms])  # [k, 3, L]
    firsts, tps, owner = rows[:, 0], rows[:, 1], rows[:, 2]
    same = owner[:, 1:] == owner[:, :-1]
    return _Holders(firsts.T.tolist(), tps.min(axis=0).tolist(), same.all(axis=0).tolist(),
                    same.any(axis=0).tolist(), owner)


def _segment_columns(cache: CostCache, holders: _Holders) -> list[Column]:
    """Per layer, one bucket per segment (layers of the same holders) charged on its first layer, the others
    `NOTHING`."""
    columns: list[Column] = []
    by_layer, whole = holders.by_layer, holders.whole
    for layer, devices in enumerate(by_layer):
        if layer and whole[layer - 1]:
            columns.append(NOTHING)
            continue
        size = 1
        while layer + size < len(by_layer) and whole[layer + size - 1]:
            size += 1
        columns.append(_column(cache, devices, holders.least[layer], size * cache.layer_grad_bytes))
    return columns


def _end_columns(cache: CostCache, pipes: Sequence[PipeEval]) -> tuple[Column, Column]:
    """The embedding's column (first stages) and the head's (last stages)."""
    lasts = [pipe.stages[-1] for pipe in pipes]
    head = _column(cache, [st[0] for st in lasts], min(len(st) for st in lasts), cache.head_grad_bytes)
    return _embed_column(cache, pipes), head


def _embed_column(cache: CostCache, pipes: Sequence[PipeEval]) -> Column:
    """The embedding's column (its holders: the first stages)."""
    firsts = [pipe.stages[0] for pipe in pipes]
    return _column(cache, [st[0] for st in firsts], min(len(st) for st in firsts), cache.embed_grad_bytes)


def dp_finish_floor(cache: CostCache, pipes: Sequence[PipeEval], ends: Sequence[float]) -> float:
    """A lower bound on `dp_finish` (seconds), cheap: with overlap, the embedding's bucket alone after the
    slowest pipeline, on free NICs (in `dp_finish` it begins no earlier and waits for no less: the same sums,
    so never above it in floating point either); else the slowest pipeline."""
    slowest = max(ends)
    if len(pipes) < 2 or not cache.params.dp_overlap:
        return slowest
    embed = _embed_column(cache, pipes)
    return NicQueue().run(slowest, *embed)


def dp_finish(cache: CostCache, pipes: Sequence[PipeEval], ends: Sequence[float],
              caches: Sequence[CostCache] | None = None) -> float:
    """Seconds from the iteration start until every pipeline's backward and every DP reduction has ended
    (module docstring). `ends[p]`: when pipeline p's last backward ends (s); `caches[p]`: the cache of its
    micro-batch size (default `cache` for all)."""
    slowest = max(ends)
    if len(pipes) < 2:
        return slowest
    if not cache.params.dp_overlap:
        return slowest + _sequential(cache, pipes)
    terms = [pipe_terms(c, pipe) for c, pipe in zip(caches or [cache] * len(pipes), pipes, strict=True)]
    at = np.asarray(ends, dtype=np.float64)
    layer_ready = (np.stack([t.ready for t in terms]) + at[:, None]).max(axis=0).tolist()
    head_ready = max(e + t.head_s for e, t in zip(ends, terms, strict=True))
    return _timeline(cache, _holders(terms), layer_ready, head_ready, _end_columns(cache, pipes), slowest)


def dp_finish_below(cache: CostCache, pipes: Sequence[PipeEval], ends: Sequence[float], bound: float
                    ) -> float | None:
    """`dp_finish` (one cache), or None when it is at least `bound` seconds as the pipelines whose `PipeTerms`
    are memoised already show (`_known_floor`, when some are and some are not: the others' ready times are not
    computed)."""
    if len(pipes) >= 2 and cache.params.dp_overlap and bound < float("inf"):
        known = [_memoised_terms(cache, pipe) for pipe in pipes]
        if None in known and any(known) and _known_floor(cache, pipes, ends, known, bound) >= bound:
            return None
    return dp_finish(cache, pipes, ends)


def _memoised_terms(cache: CostCache, pipe: PipeEval) -> PipeTerms | None:
    """`pipe_terms` of `pipe` when memoised already, else None (nothing computed)."""
    memo = cache.memo(DpMemo).terms
    mine = memo.get(id(pipe))
    if mine is not None and mine[0] is pipe:
        return mine[1]  # type: ignore[no-any-return]
    return memo.get((pipe.stages, pipe.counts))  # type: ignore[return-value]


def _known_floor(cache: CostCache, pipes: Sequence[PipeEval], ends: Sequence[float],
                 known: Sequence[PipeTerms | None], bound: float = float("inf")) -> float:
    """A lower bound on `dp_finish` (seconds): its timeline with every layer (and the head) ready when the
    pipelines of `known` (their `PipeTerms`, None where not memoised) have finished it. A layer's ready time is a
    max over the pipelines, so over some of them it is no later (-inf over none), and every later step of the
    timeline (max, +, `NicQueue.run`) is monotone in it, in floating point too: never above `dp_finish`. The
    others need only their layers' holders (`_rows`), not their ready times. The timeline stops once a bucket
    ends at `bound` or later (what it returns then is that bucket's end: at least `bound`, still a lower bound)."""
    terms = [t if t is not None else PipeTerms(_rows(pipe), np.full(sum(pipe.counts), -np.inf), -np.inf)
             for t, pipe in zip(known, pipes, strict=True)]
    at = np.asarray(ends, dtype=np.float64)
    layer_ready = (np.stack([t.ready for t in terms]) + at[:, None]).max(axis=0).tolist()
    head_ready = max(e + t.head_s for e, t in zip(ends, terms, strict=True))
    return _timeline(cache, _holders(terms), layer_ready, head_ready, _end_columns(cache, pipes), max(ends), bound)


def _timeline(cache: CostCache, holders: _Holders, layer_ready: list[float], head_ready: float,
              end_columns: tuple[Column, Column], slowest: float, stop_at: float = float("inf")) -> float:
    """When the last bucket ends (at least `slowest`): the head's bucket from `head_ready`, then the layers
    top-down from their ready times, then the embedding after the slowest pipeline, each after the one before
    where they share a holder, the cross-node parts queued on the NICs (seconds; `end_columns`: the embedding's
    and the head's columns). A layer's column is its segment's (layers of the same holders), computed where the
    segment begins from the top; the timeline stops at the first bucket that ends at `stop_at` or later, and returns
    that end (a lower bound on the whole timeline's)."""
    embed, head = end_columns
    run = NicQueue().run
    end = run(head_ready, *head)
    latest = end
    if latest >= stop_at:
        return latest
    by_layer, least, whole, shares = holders.by_layer, holders.least, holders.whole, holders.shares
    grad_bytes = cache.layer_grad_bytes
    top = len(by_layer) - 1
    column = NOTHING
    for layer in range(top, -1, -1):
        if layer == top or not whole[layer]:  # the top of a segment: its holders' column
            column = _column(cache, by_layer[layer], least[layer], grad_bytes)
        inside, across, nodes = column
        begin = layer_ready[layer]
        if (layer == top or shares[layer]) and end > begin:
            begin = end
        end = run(begin, inside, across, nodes)
        if end > latest:
            latest = end
            if latest >= stop_at:
                return latest
    end = run(max(slowest, end), *embed)
    return max(latest, end, slowest)


def _load(nic: dict[int, float], col: Column) -> None:
    """Add the cross-node part of `col` to the NIC load of every node it uses."""
    if col[1] > 0:
        for n in col[2]:
            nic[n] = nic.get(n, 0.0) + col[1]


def _sequential(cache: CostCache, pipes: Sequence[PipeEval]) -> float:
    """Without overlap: the longest reduction of one stage (one bucket per segment of its layers, the
    embedding on first stages, the head on last stages, one after another) or of one node's NIC (every
    cross-node part of every bucket that node is in), seconds."""
    holders = _holders([pipe_terms(cache, pipe) for pipe in pipes])
    columns, owner = _segment_columns(cache, holders), holders.owner
    embed, head = _end_columns(cache, pipes)
    stages = np.array([len(pipe.stages) for pipe in pipes], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(stages)[:-1]])
    per_layer = np.array([c[0] + c[1] for c in columns])
    count = len(pipes)
    sums = np.bincount((owner + offsets[:, None]).ravel(), weights=np.tile(per_layer, count),
                       minlength=int(stages.sum()))
    sums[offsets] += embed[0] + embed[1]
    sums[offsets + stages - 1] += head[0] + head[1]
    nic: dict[int, float] = {}
    for col in (*columns, embed, head):
        _load(nic, col)
    node = cache.graph.node_list
    heads = [st[0] for pipe in pipes for st in pipe.stages]
    busiest = np.array([nic.get(node[i], 0.0) for i in heads])
    return float(np.maximum(sums, busiest).max())

"""The fast score's data-parallel term: what cost/dp.py charges, cheap enough for thousands of candidates.

Every layer is held by one stage per pipeline; its gradient is all-reduced among those holders through their
first devices (pipeline order), flat or hierarchically (`CostParams.dp_hierarchical`, as `cost.dp.bucket_cost`):
- flat: one ring over the holders' nodes at its slowest hop, volume n / min TP on one node, else the whole n
  (the TP slices' rings share every NIC they cross);
- hierarchical, where the holders span several nodes and some node has two or more: a ring inside every such
  node (volume n / min TP, the slowest node sets the time), then a ring of the whole n among one leader per
  node at the leaders' slowest hop.
Bucket seconds come from `cost.comm`'s ring formulas (bandwidth and latency of the ring's slowest hop), as in
`cost.dp`. Layers whose holders are the same stages form one segment and cost the same: durations are
computed per segment, memoised on the `CostCache` by the holders' nodes.

With `CostParams.dp_overlap` (the runtime's default) a layer's bucket starts when every holder has finished its
last backward through that layer (pipeline p ends its last backward at `ends[p]`; stage s of it ends
sum_{j<s} (B_j + p2p_j) earlier, B_j its whole last backward, and passes its layers top-down, head first on the
last stage, embedding last on the first), in the runtime's order (head, layers top-down, embedding), each after
the previous bucket where they share a holder (a stage's buckets run one after another); every node's NIC must
also carry the cross-node parts of all buckets it is in. The term is when the last bucket ends (at least the
slowest pipeline's end). Without overlap every reduction starts after the slowest pipeline, a stage's buckets
one after another, and a node's NIC queues every ring that crosses it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..cost.comm import ring_allreduce_seconds, ring_link
from .fastcost import CostCache
from .pipeline import PipeEval

Column = tuple[float, float, tuple[int, ...]]  # (inside_s, across_s, nodes whose NIC the across part uses)


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
    memo = cache.dp_rows
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
    count = len(pipe.stages)
    times = [cache.stage(st) for st in pipe.stages]
    firsts: list[int] = []
    tps: list[int] = []
    owner: list[int] = []
    ready: list[float] = []
    end, head = 0.0, 0.0  # end: this stage's last backward end
    previous = 0.0  # the stage before's whole last backward
    for s, (lt, n, devs) in enumerate(zip(times, pipe.counts, pipe.stages, strict=True)):
        whole = n * lt.bwd_s + (lt.embed_bwd_s if s == 0 else 0.0) + (lt.head_bwd_s if s == count - 1 else 0.0)
        if s:
            end -= previous + cache.p2p(devs, pipe.stages[s - 1])
        start = end - whole + (lt.head_bwd_s if s == count - 1 else 0.0)  # the layers' backward begins
        ready.extend([start + lt.bwd_s * j for j in range(n, 0, -1)])
        firsts.extend([devs[0]] * n)
        tps.extend([len(devs)] * n)
        owner.extend([s] * n)
        if s == count - 1:
            head = start
        previous = whole
    return PipeTerms(np.array([firsts, tps, owner], dtype=np.int64), np.array(ready), head)


def _column(cache: CostCache, devices: Sequence[int], min_tp: int, nbytes: float) -> Column:
    """Seconds of one all-reduce of `nbytes` among holders whose first devices are `devices` (pipeline order),
    by `cost.comm`'s ring formulas on those devices' links; memoised by the devices' nodes (holders on equal
    nodes cost the same)."""
    memo = cache.dp_rows
    exact = ("dev", tuple(devices), min_tp, nbytes)
    hit = memo.get(exact)
    if hit is not None:
        return hit  # type: ignore[return-value]
    node = cache.graph.node_list
    nodes = tuple([node[i] for i in devices])
    key = ("col", nodes, min_tp, nbytes)
    hit = memo.get(key)
    if hit is not None:
        memo[exact] = hit
        return hit  # type: ignore[return-value]
    cluster, ids, eff = cache.graph.cluster, cache.graph.ids, cache.params.dp_comm_efficiency
    by_node: dict[int, list[str]] = {}
    for i in devices:
        by_node.setdefault(node[i], []).append(ids[i])

    def ring(members: list[str], size: float) -> float:
        bandwidth, latency = ring_link(cluster, members)
        return ring_allreduce_seconds(len(members), size, bandwidth * eff, latency)

    if len(by_node) == 1:
        hit = (ring([ids[i] for i in devices], nbytes / min_tp), 0.0, ())
    elif cache.params.dp_hierarchical and max(len(m) for m in by_node.values()) > 1:
        inside = max(ring(m, nbytes / min_tp) for m in by_node.values() if len(m) > 1)
        hit = (inside, ring([m[0] for m in by_node.values()], nbytes), tuple(sorted(by_node)))
    else:
        hit = (0.0, ring([ids[i] for i in devices], nbytes), tuple(sorted(by_node)))
    memo[key] = memo[exact] = hit
    return hit


NOTHING: Column = (0.0, 0.0, ())


def _layer_columns(cache: CostCache, terms: Sequence[PipeTerms], merged: bool = False
                   ) -> tuple[list[Column], list[bool], np.ndarray]:
    """Per layer: its bucket's column; whether it shares a holder with the layer above (entry l for layers l
    and l + 1, L - 1 of them); every pipeline's stage index per layer (int64 [k, L]). `merged`: one bucket per segment (layers of the same holders), charged on
    its first layer, the others get `NOTHING`."""
    rows = np.stack([t.rows for t in terms])  # [k, 3, L]
    firsts, tps, owner = rows[:, 0], rows[:, 1], rows[:, 2]
    same = owner[:, 1:] == owner[:, :-1]
    columns: list[Column] = []
    whole = same.all(axis=0).tolist()
    by_layer = firsts.T.tolist()  # [L][k] the holders' first devices
    least = tps.min(axis=0).tolist()
    for layer, devices in enumerate(by_layer):
        if layer and whole[layer - 1]:
            columns.append(NOTHING if merged else columns[-1])
            continue
        size = 1
        while merged and layer + size < len(by_layer) and whole[layer + size - 1]:
            size += 1
        columns.append(_column(cache, devices, least[layer], size * cache.layer_grad_bytes))
    return columns, same.any(axis=0).tolist(), owner


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
    return _Nics().bucket(_embed_column(cache, pipes), slowest)


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
    columns, shares, _ = _layer_columns(cache, terms)
    embed, head = _end_columns(cache, pipes)
    at = np.asarray(ends, dtype=np.float64)
    layer_ready = (np.stack([t.ready for t in terms]) + at[:, None]).max(axis=0).tolist()
    head_ready = max(e + t.head_s for e, t in zip(ends, terms, strict=True))
    nics = _Nics()
    # head, then layers top-down, then the embedding, each after the one before where they share a holder;
    # the cross-node part also waits for its NICs
    end = nics.bucket(head, head_ready)
    latest = end
    top = len(columns) - 1
    for layer in range(top, -1, -1):
        col = columns[layer]
        begin = layer_ready[layer]
        if layer == top or shares[layer]:
            begin = max(begin, end)
        end = nics.bucket(col, begin)
        latest = max(latest, end)
    end = nics.bucket(embed, max(slowest, end))
    return max(latest, end, slowest)


class _Nics:
    """When each node's NIC is next free (seconds), for buckets run one after another. The NICs of the last
    cross-node bucket are written back only when a bucket with other nodes comes: layers of one segment share a
    column, whose NICs the bucket before has just freed, all at once."""

    def __init__(self) -> None:
        self.free: dict[int, float] = {}
        self.last: Column | None = None  # the last bucket with a cross-node part, its NICs not yet written
        self.done = 0.0  # when it freed them

    def bucket(self, col: Column, begin: float) -> float:
        """End (s) of one bucket that may begin at `begin`: the intra-node half, the cross-node part once its NICs
        are free (which it then holds), the other intra-node half."""
        across = begin + col[0] / 2
        if col[2]:
            if col is self.last:
                if self.done > across:
                    across = self.done
            else:
                free = self.free
                if self.last is not None:
                    for n in self.last[2]:
                        free[n] = self.done
                for n in col[2]:
                    wait = free.get(n, 0.0)
                    if wait > across:
                        across = wait
                self.last = col
            self.done = across + col[1]
            return self.done + col[0] / 2
        return across + col[1] + col[0] / 2


def _load(nic: dict[int, float], col: Column) -> None:
    """Add the cross-node part of `col` to the NIC load of every node it uses."""
    if col[1] > 0:
        for n in col[2]:
            nic[n] = nic.get(n, 0.0) + col[1]


def _sequential(cache: CostCache, pipes: Sequence[PipeEval]) -> float:
    """Without overlap: the longest reduction of one stage (one bucket per segment of its layers, the
    embedding on first stages, the head on last stages, one after another) or of one node's NIC (every
    cross-node part of every bucket that node is in), seconds."""
    columns, _, owner = _layer_columns(cache, [pipe_terms(cache, pipe) for pipe in pipes], merged=True)
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

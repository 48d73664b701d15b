"""Phase 1 and 2 of the flashflex strategy's search: candidates for every pipeline count k and device subset.

For the whole cluster and for subsets without its slowest kinds of device (`partition.device_subsets`), for k =
1, 2, ... pipelines (up to what memory and the batch allow; on the whole cluster, k past `SURE_KS` only while it
may pay), each level-1 partition (`partition.generators`) is turned into pipelines by level 2
(`stage_search.best_pipeline`) and scored (`candidate.score`). Every (k, devices) is one unit of a
`pool.SearchPool`; results are merged in the units' order, so the candidates do not depend on the number of
workers. The deadline is checked between units.

On a cluster of more than `THOROUGH_DEVICES` devices both phases run a quick pass: each pipeline's structure is
its best start (one TP degree per node class, `best_pipeline(descent=False)`), and only the `DESCENDED` best
partitions within `DESCENT_BAND` of the best quick candidate get the coordinate descent, as candidates beside their
quick ones (the descent improves each pipeline alone, so the layout can score worse, for the data-parallel
reductions between unlike pipelines; the final ranking by `cost.estimate` picks between them). On the benchmark
clusters (`benchmarks/bench_planning_time.py`, 2026-12-07) the descent made a pipeline 1.0-1.3x faster at the 90th
percentile, 1.25-1.8x at the 99th, so a partition 1.5x behind the best before it hardly ever wins after it; and most
of the search's time went to partitions far behind (mixed-1024: 5.4 of the 6.0 s of both phases to candidates more
than 2x slower than the best). The two passes take 0.40-0.73x the CPU time of descending every partition there,
with the same plan or a faster one.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

from ..scoring.candidate import Candidate, score
from ..scoring.cost_cache import CostCache
from ..scoring.feasibility import model_state_bytes
from ..space.partition import device_subsets, generators
from ..structure.stage_search import THOROUGH_DEVICES, best_pipeline
from .pool import SearchPool

PHASE2_KS = 3
DENSE_KS = 16  # every k up to this, then steps of about x1.5
SURE_KS = 8  # k values up to this are always searched; larger ones (the tail) while they may pay
TAIL_BATCH = 2  # tail k values searched together (whatever the number of workers: the result does not depend on it)
TAIL_STOP = 2.0  # the tail stops after a batch whose best new candidate is this many times slower than the best
DESCENDED = 8  # partitions given the structure descent after a large cluster's quick pass, the best first
DESCENT_BAND = 1.5  # ... those at most this many times slower than the best quick candidate
Origin = tuple[int, tuple[int, ...], int]  # a candidate's partition: (k, active devices, position in `generators`)


class Unit(NamedTuple):
    """One unit of work of `collect_candidates`: the partitions of `active` into k groups, scored."""

    total_micro: int  # micro-batches in a step
    seed: int
    k: int  # pipelines
    active: tuple[int, ...]  # the devices partitioned
    deadline: float  # time.monotonic() seconds
    check: bool  # whether to stop at the deadline
    descent: bool  # each pipeline's structure with the coordinate descent (else its best start)
    only: int | None  # the one partition to search, by its position in `generators`; None: all of them


class SearchStats:
    """What the search did (for the CLI summary): candidates scored, whether the budget cut it short."""

    def __init__(self) -> None:
        self.candidates = 0
        self.estimated = 0
        self.budget_hit = False
        self.seconds = 0.0


def pipeline_counts(cache: CostCache, total_micro: int, devices: int | None = None) -> list[int]:
    """k values to try for `devices` devices (default all): every k up to `DENSE_KS`, then about x1.5 steps, up
    to what memory (each pipeline needs enough devices to hold the model's state) and the batch allow."""
    g = cache.graph
    need = model_state_bytes(cache)
    biggest = max(cache.capacity((i,)) - cache.params.memory_reserve_bytes for i in range(g.size))
    fewest = max(1, math.ceil(need / max(biggest, 1.0)))  # devices one pipeline needs at least
    top = max(1, min((devices or g.size) // fewest, total_micro))
    ks, k = [], 1
    while k <= top:
        ks.append(k)
        k = k + 1 if k < DENSE_KS else int(k * 1.5)
    # a sharded search charges each stage 1 / ways of its optimizer state: layouts of at least that many replicas,
    # and fewer than twice as many (the next search's: planner/search/sharding.py runs one per power of two)
    ways = cache.optimizer_shard_ways
    return ks if ways == 1 else [k for k in ks if ways <= k < 2 * ways]


def collect_candidates(pool: SearchPool, total_micro: int, seed: int, deadline: float, stats: SearchStats,
             every_k: bool = False) -> list[Candidate]:
    """Phase 1: every k on the whole cluster up to `SURE_KS`, then the larger k values (`pipeline_counts`)
    `TAIL_BATCH` at a time until a batch's best new candidate is `TAIL_STOP` times slower than the best found
    (more, smaller pipelines only add data-parallel traffic and cuts across nodes from there; `every_k`: all of
    them). Phase 2: the subsets without the slowest kinds of device, for the k values near the best phase-1
    candidates (scaled to the subset's size). On a large cluster both are quick passes, then the best partitions
    get the descent (module docstring). Every (k, devices) is one unit of `pool`; results are merged in the
    units' order."""
    cache = pool.cache
    g = cache.graph
    descent = g.size <= THOROUGH_DEVICES
    found: list[Candidate] = []
    origins: list[Origin] = []
    subsets = device_subsets(g)
    full = tuple(subsets[0])
    ks = pipeline_counts(cache, total_micro, len(full))
    sure = [k for k in ks if k <= SURE_KS]
    units = [Unit(total_micro, seed, k, full, deadline, n > 0, descent, None) for n, k in enumerate(sure)]
    if _merge(cache, units, pool.map(collect_unit, units), found, origins, stats):
        return found
    tail = [Unit(total_micro, seed, k, full, deadline, True, descent, None) for k in ks[len(sure):]]
    for start in range(0, len(tail), TAIL_BATCH):
        units = tail[start:start + TAIL_BATCH]
        before = min((c.score_s for c in found), default=float("inf"))
        seen = {c.signature() for c in found}
        count = len(found)
        if _merge(cache, units, pool.map(collect_unit, units), found, origins, stats):
            return found
        # (a partition repeated at a larger k, e.g. striped past the devices per node, is not news)
        best = min((c.score_s for c in found[count:] if c.signature() not in seen), default=float("inf"))
        if not every_k and best >= TAIL_STOP * before:
            break
    if cache.optimizer_shard_ways == 1:  # (a sharded search: its band of replica counts on the whole cluster only)
        best_ks: list[int] = []
        for cand in sorted(found, key=lambda c: (c.score_s, c.signature())):
            if len(cand.pipes) not in best_ks:
                best_ks.append(len(cand.pipes))
            if len(best_ks) == PHASE2_KS:
                break
        units = []
        for active in subsets[1:]:
            allowed = pipeline_counts(cache, total_micro, len(active))
            near = set()
            for k in best_ks:
                scaled = max(1, round(k * len(active) / len(full)))
                near.update(x for x in (scaled - 1, scaled, scaled + 1, k) if x in allowed)
            units.extend(Unit(total_micro, seed, k, tuple(active), deadline, True, descent, None) for k in sorted(near))
        if _merge(cache, units, pool.map(collect_unit, units), found, origins, stats):
            return found
    if not descent:
        units = [Unit(total_micro, seed, k, active, deadline, True, True, position)
                 for k, active, position in _to_descend(found, origins)]
        _merge(cache, units, pool.map(collect_unit, units), found, origins, stats)
    return found


def _to_descend(found: list[Candidate], origins: list[Origin]) -> list[Origin]:
    """The partitions of the `DESCENDED` best candidates by (score, signature) that are at most `DESCENT_BAND` times
    slower than the best. (Partitions of different device subsets can give one quick layout, the devices that only
    one of them has left idle, and different ones after the descent: each is searched.)"""
    ranked = sorted(range(len(found)), key=lambda j: (found[j].score_s, found[j].signature()))
    limit = DESCENT_BAND * found[ranked[0]].score_s if ranked else 0.0
    return [origins[j] for j in ranked[:DESCENDED] if found[j].score_s <= limit]


def collect_unit(cache: CostCache, unit: Unit) -> tuple[list[Candidate], list[Origin], int, bool]:
    """One unit of `collect_candidates`: (candidates, their partitions, how many were scored, whether the deadline
    had passed)."""
    if unit.check and time.monotonic() >= unit.deadline:
        return [], [], 0, True
    stats = SearchStats()
    cands, positions = _candidates_for(cache, unit.total_micro, unit.seed, unit.k, list(unit.active), stats,
                                       unit.descent, unit.only)
    return cands, [(unit.k, unit.active, position) for position in positions], stats.candidates, False


def _merge(cache: CostCache, units: list[Unit], results: list[tuple[list[Candidate], list[Origin], int, bool]],
           found: list[Candidate], origins: list[Origin], stats: SearchStats) -> bool:
    """Append units' candidates (and their partitions to `origins`) in order up to the first one the deadline
    stopped once something was found (a stopped unit before that runs here after all); True if the deadline
    stopped one."""
    for unit, (cands, where, count, hit) in zip(units, results, strict=True):
        if hit and found:
            stats.budget_hit = True
            return True
        if hit:
            cands, where, count, _ = collect_unit(cache, unit._replace(check=False))
        found.extend(cands)
        origins.extend(where)
        stats.candidates += count
    return False


def _candidates_for(cache: CostCache, total_micro: int, seed: int, k: int, active: list[int],
                    stats: SearchStats, descent: bool = True, only: int | None = None
                    ) -> tuple[list[Candidate], list[int]]:
    """One candidate per level-1 partition of `active` into k groups (`only`: the one at that position in
    `generators`), each pipeline's structure with or without the descent; and each one's position."""
    g = cache.graph
    total_flops = float(g.flops[active].sum())
    out, positions = [], []
    for position, (_name, groups) in enumerate(generators(g, k, seed, active)):
        if only is not None and position != only:
            continue
        pipes = []
        for group in groups:
            share = float(g.flops[group].sum()) / total_flops
            pipe = best_pipeline(cache, group, max(1, round(total_micro * share)), total_micro, descent=descent)
            if pipe is not None:
                pipes.append(pipe)
        cand = score(cache, pipes, total_micro)
        stats.candidates += 1
        if cand is not None:
            out.append(cand)
            positions.append(position)
    return out, positions

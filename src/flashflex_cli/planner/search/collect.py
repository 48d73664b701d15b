"""Phase 1 and 2 of the flashflex strategy's search: candidates for every pipeline count k and device subset.

For the whole cluster and for subsets without its slowest kinds of device (`partition.device_subsets`), for k =
1, 2, ... pipelines (up to what memory and the batch allow; on the whole cluster, k past `SURE_KS` only while it
may pay), each level-1 partition (`partition.generators`) is turned into pipelines by level 2
(`stage_search.best_pipeline`) and scored (`candidate.score`). Every (k, devices) is one unit of a
`pool.SearchPool`; results are merged in the units' order, so the candidates do not depend on the number of
workers. The deadline is checked between units.
"""

from __future__ import annotations

import math
import time

from ..scoring.candidate import Candidate, score
from ..scoring.cost_cache import CostCache
from ..scoring.feasibility import model_state_bytes
from ..space.partition import device_subsets, generators
from ..structure.stage_search import best_pipeline
from .pool import SearchPool

PHASE2_KS = 3
DENSE_KS = 16  # every k up to this, then steps of about x1.5
SURE_KS = 8  # k values up to this are always searched; larger ones (the tail) while they may pay
TAIL_BATCH = 2  # tail k values searched together (whatever the number of workers: the result does not depend on it)
TAIL_STOP = 2.0  # the tail stops after a batch whose best new candidate is this many times slower than the best


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
    candidates (scaled to the subset's size). Every (k, devices) is one unit of `pool`; results are merged in
    the units' order."""
    cache = pool.cache
    g = cache.graph
    found: list[Candidate] = []
    subsets = device_subsets(g)
    full = tuple(subsets[0])
    ks = pipeline_counts(cache, total_micro, len(full))
    sure = [k for k in ks if k <= SURE_KS]
    units = [(total_micro, seed, k, full, deadline, n > 0) for n, k in enumerate(sure)]
    if _merge(cache, units, pool.map(collect_unit, units), found, stats):
        return found
    tail = [(total_micro, seed, k, full, deadline, True) for k in ks[len(sure):]]
    for start in range(0, len(tail), TAIL_BATCH):
        units = tail[start:start + TAIL_BATCH]
        before = min((c.score_s for c in found), default=float("inf"))
        seen = {c.signature() for c in found}
        count = len(found)
        if _merge(cache, units, pool.map(collect_unit, units), found, stats):
            return found
        # (a partition repeated at a larger k, e.g. striped past the devices per node, is not news)
        best = min((c.score_s for c in found[count:] if c.signature() not in seen), default=float("inf"))
        if not every_k and best >= TAIL_STOP * before:
            break
    if cache.optimizer_shard_ways > 1:  # a sharded search: its band of replica counts on the whole cluster only
        return found
    best_ks = []
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
        units.extend((total_micro, seed, k, tuple(active), deadline, True) for k in sorted(near))
    _merge(cache, units, pool.map(collect_unit, units), found, stats)
    return found


def collect_unit(cache: CostCache, item: tuple[int, int, int, tuple[int, ...], float, bool]
          ) -> tuple[list[Candidate], int, bool]:
    """One unit of `collect_candidates`: (candidates, how many were scored, whether the deadline had passed)."""
    total_micro, seed, k, active, deadline, check = item
    if check and time.monotonic() >= deadline:
        return [], 0, True
    stats = SearchStats()
    out = _candidates_for(cache, total_micro, seed, k, list(active), stats)
    return out, stats.candidates, False


def _merge(cache: CostCache, units: list, results: list[tuple[list[Candidate], int, bool]],
           found: list[Candidate], stats: SearchStats) -> bool:
    """Append units' candidates in order up to the first one the deadline stopped once something was found
    (a stopped unit before that runs here after all); True if the deadline stopped one."""
    for unit, (cands, count, hit) in zip(units, results, strict=True):
        if hit and found:
            stats.budget_hit = True
            return True
        if hit:
            cands, count, _ = collect_unit(cache, (*unit[:-1], False))
        found.extend(cands)
        stats.candidates += count
    return False


def _candidates_for(cache: CostCache, total_micro: int, seed: int, k: int, active: list[int],
                    stats: SearchStats) -> list[Candidate]:
    """One candidate per level-1 partition of `active` into k groups."""
    g = cache.graph
    total_flops = float(g.flops[active].sum())
    out = []
    for _name, groups in generators(g, k, seed, active):
        pipes = []
        for group in groups:
            share = float(g.flops[group].sum()) / total_flops
            pipe = best_pipeline(cache, group, max(1, round(total_micro * share)), total_micro)
            if pipe is not None:
                pipes.append(pipe)
        cand = score(cache, pipes, total_micro)
        stats.candidates += 1
        if cand is not None:
            out.append(cand)
    return out

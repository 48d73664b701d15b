"""`plan_layout`: the planner's entry point, one code path for every strategy.

flashflex (default): candidates for every pipeline count on the whole cluster and on subsets without its slowest
kinds of device (`collect`: level-1 partitions turned into pipelines by level 2, `structure.stage_search`, the
batch split over them, `space.batch_split`). The uniform baseline's layouts join as candidates too, re-split
by our splits and exactly as the baseline runs them (the symmetric layout is part of our space, so
flashflex never predicts below uniform, except where uniform's TP groups straddle a slow intra-node
link, which flashflex never does). The best few candidates by the fast score are refined
(`refine.refine`: whole-group and device-level moves), and the finalists are ranked by `cost.estimate.estimate`
alone (`finalise`).

With `max_micro_batch`, every finalist also gets a variant whose pipelines each take their own micro-batch
size and count (`microbatch.MicroBatchSearch`), and `estimate` ranks both.

Independent units (each k of a phase, each candidate to refine) run in a process pool (`pool.SearchPool`,
`jobs` workers), merged in their fixed order.
Determinism: candidates are generated in a fixed order, every collection is sorted, pymetis is seeded,
and ties break on the layout's canonical signature: the same inputs and seed give a byte-identical plan,
with any number of workers.
The time budget is only checked between whole units of work (a k, a partition, a move); when it cuts the
search short, the result depends on the machine's speed (the CLI says so). The bundled plans and the tests
finish far inside their budgets.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ...cost.params import CostParams
from ...errors import InputError
from ...hardware.cluster import Cluster
from ...model.spec import ModelSpec
from ...plan.schema import Plan, TrainConfig
from ..scoring.candidate import Candidate, score
from ..scoring.cost_cache import CostCache
from ..scoring.feasibility import check_feasible
from ..scoring.pipeline_score import PipeEval, evaluate_pipeline
from ..space.batch_split import micro_batches
from ..space.graph import DeviceGraph
from .collect import SearchStats, collect_candidates
from .exhaustive import exhaustive_candidates
from .finalise import FINALISTS, finalise, nothing_fits, ranked_unique
from .microbatch import MicroBatchSearch
from .pool import SearchPool
from .refine import refine
from .uniform import best_uniform, equal_layers, uniform_layouts

STRATEGIES = ("flashflex", "uniform", "exhaustive")
REFINED = 2
SHARDED_FINALISTS = 2  # candidates a sharded search estimates exactly (with their shard weights)


def _refine_unit(cache: CostCache, item: tuple[Candidate, int, int, float, bool]
                 ) -> tuple[Candidate, dict[int, str]] | None:
    """`refine` of one candidate; None when the deadline had passed before it started."""
    cand, total_micro, seed, deadline, device_moves = item
    if time.monotonic() >= deadline:
        return None
    return refine(cache, cand, total_micro, seed, deadline, device_moves=device_moves)


def _uniform_seeds(cache: CostCache, total_micro: int) -> tuple[list[Candidate], list[Candidate]]:
    """The uniform baseline's best layouts: (re-split by our layer and batch splits, exactly as uniform);
    layouts with a TP group across two fast-link islands are left out."""
    resplit, exact = [], []
    island = cache.graph.island
    for layout in uniform_layouts(cache, total_micro)[:FINALISTS]:
        if any(len({int(island[i]) for i in st}) > 1 for stages in layout.pipelines for st in stages):
            continue  # a TP group across a slow intra-node link: outside flashflex's space
        pipes = [evaluate_pipeline(cache, stages) for stages in layout.pipelines]
        cand = score(cache, pipes, total_micro)
        if cand is not None:
            resplit.append(cand)
        counts = tuple(equal_layers(cache.model.num_layers, layout.pp))
        same = [PipeEval(p.stages, counts, p.pace_s, p.fill_s, p.shard_bytes, True, p.stage_grad_bytes)
                for p in pipes]
        exact.append(Candidate(tuple(same), (total_micro // layout.dp,) * layout.dp, layout.score_s))
    return resplit, exact


def plan_layout(cluster: Cluster, model: ModelSpec, train: TrainConfig, strategy: str = "flashflex",
                time_budget_s: float = 30.0, seed: int = 0, params: CostParams | None = None,
                stats: SearchStats | None = None, device_moves: bool = True,
                max_micro_batch: int | None = None, jobs: int = 1, micro_batch: int = 1,
                optimizer_shard_ways: int = 1, graph: DeviceGraph | None = None) -> Plan:
    """Plan an asymmetric layout of `model` on `cluster` for `train` (module docstring); InfeasibleError
    when none exists; InputError for an unknown strategy. `device_moves=False` limits refinement to
    whole-group moves (to measure what the device-level moves add). `micro_batch`: the base micro-batch size
    (sequences). `max_micro_batch`: None pins every pipeline's micro-batch size to `micro_batch`; a number lets
    the flashflex strategy choose each pipeline's size among micro_batch x 2^j up to it
    (`microbatch.MicroBatchSearch`). `jobs`:
    worker processes for the search's independent units (`pool.SearchPool`; the plan does not depend on it).
    `optimizer_shard_ways` > 1: plans that shard their optimizer state, the search charging each stage that
    share of it (planner/search/sharding.py chooses). `graph`: the `DeviceGraph(cluster, train.dtype)` that
    another search of the same cluster built (its tables and partitions are reused)."""
    if graph is None:
        graph = DeviceGraph(cluster, train.dtype)
    elif graph.cluster is not cluster or graph.dtype != train.dtype:
        raise ValueError("plan_layout: the graph given is of another cluster or dtype")
    with _no_cycle_collection():
        return _plan_layout(graph, model, train, strategy, time_budget_s, seed, params, stats, device_moves,
                            max_micro_batch, jobs, micro_batch, optimizer_shard_ways)


def searches_of(cluster: Cluster, model: ModelSpec, train: TrainConfig, **options: Any) -> Callable[[int], Plan]:
    """`plan_layout` of `cluster` for each optimizer-shard ways (`sharding.choose_sharding`'s `plan_with`), with
    the other `options` of `plan_layout`: the searches share one `DeviceGraph` (its tables and partitions)."""
    graph = DeviceGraph(cluster, train.dtype)
    return lambda ways: plan_layout(cluster, model, train, optimizer_shard_ways=ways, graph=graph, **options)


@contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Python's cyclic garbage collector paused while the search runs: the search allocates millions of short-lived
    objects and keeps large memo tables (the collector's passes over them cost about 7% of the planning time), but
    makes almost no reference cycles (a few dozen objects a plan), which the next collection frees."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan_layout(graph: DeviceGraph, model: ModelSpec, train: TrainConfig, strategy: str, time_budget_s: float,
                 seed: int, params: CostParams | None, stats: SearchStats | None, device_moves: bool,
                 max_micro_batch: int | None, jobs: int, micro_batch: int, optimizer_shard_ways: int = 1) -> Plan:
    """`plan_layout` itself."""
    if strategy not in STRATEGIES:
        raise InputError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if max_micro_batch is not None and max_micro_batch < 1:
        raise InputError(f"--max-micro-batch must be at least 1, got {max_micro_batch}")
    started = time.monotonic()
    stats = stats if stats is not None else SearchStats()
    params = params or CostParams()
    total = micro_batches(train.global_batch, micro_batch)
    cache = CostCache(graph, model, train, params, micro_batch, optimizer_shard_ways)
    check_feasible(cache, total)
    deadline = started + max(0.0, time_budget_s)
    if strategy == "uniform":
        plan = best_uniform(cache, total, seed)
    elif strategy == "exhaustive":
        cands, stats.budget_hit = exhaustive_candidates(cache, total, deadline)
        if not cands:
            raise nothing_fits(cache)
        plan = finalise(cache, cands, strategy, seed, stats=stats, limit=2 * FINALISTS)
    else:
        resplit, exact = _uniform_seeds(cache, total)
        reasons: dict[int, dict[int, str]] = {}
        refined = []
        with SearchPool(cache, jobs) as pool:
            cands = ranked_unique(collect_candidates(pool, total, seed, deadline, stats) + resplit)
            # a sharded search (planner/search/sharding.py) ranks its band's candidates without refining them
            refine_count = 0 if optimizer_shard_ways > 1 else REFINED
            units = [(cand, total, seed, deadline, device_moves) for cand in cands[:refine_count]]
            for result in pool.map(_refine_unit, units):
                if result is None:
                    stats.budget_hit = True
                    break
                better, why = result
                reasons[id(better)] = why
                refined.append(better)
        tuned: list[Candidate] = []
        if max_micro_batch is not None:
            tuner = MicroBatchSearch(cache, max_micro_batch)
            for cand in refined + cands[:FINALISTS]:
                found = tuner.tune(cand)
                if found is not None:
                    reasons[id(found)] = reasons.get(id(cand), {})
                    tuned.append(found)
        if optimizer_shard_ways > 1:  # a sharded search: its band's layouts only, its two best estimated
            plan = finalise(cache, [c for c in refined + cands + tuned if len(c.pipes) >= optimizer_shard_ways],
                            strategy, seed, reasons, stats=stats, limit=SHARDED_FINALISTS)
        else:
            plan = finalise(cache, refined + cands, strategy, seed, reasons, stats=stats, always=exact + tuned)
    stats.seconds = time.monotonic() - started
    return plan


def scored_candidates(cluster: Cluster, model: ModelSpec, train: TrainConfig, seed: int = 0,
                      params: CostParams | None = None, micro_batch: int = 1) -> tuple[CostCache, list[Candidate]]:
    """Every candidate the flashflex strategy's search scores before refinement (both phases and the uniform
    seeds), ranked by fast score, with the cache that scored them: for benchmarks and diagnostics of the fast
    score against `cost.estimate` (no time budget, one process)."""
    params = params or CostParams()
    total = micro_batches(train.global_batch, micro_batch)
    cache = CostCache(DeviceGraph(cluster, train.dtype), model, train, params, micro_batch)
    check_feasible(cache, total)
    resplit, _ = _uniform_seeds(cache, total)
    with SearchPool(cache, 1) as pool:
        found = collect_candidates(pool, total, seed, float("inf"), SearchStats(), every_k=True)
    return cache, ranked_unique(found + resplit)

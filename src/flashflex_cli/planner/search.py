"""`plan_layout`: the planner's entry point, one code path for every strategy.

flashflex (default): for the whole cluster and for subsets without its slowest kinds of device
(`partition.device_subsets`), for k = 1, 2, ... pipelines (up to what memory and the batch allow; on the whole
cluster, k past `SURE_KS` only while it may pay: `_collect`), each
level-1 partition (`partition.generators`: pymetis, contiguous, typed, striped) is turned into pipelines
by level 2
(`stages.best_pipeline`: TP degrees per node class, stage order, exact layer split) and the batch is
split over them (`batch.split_batch`). The uniform baseline's layouts join as candidates too, re-split
by our splits and exactly as the baseline runs them (the symmetric layout is part of our space, so
flashflex never predicts below uniform, except where uniform's TP groups straddle a slow intra-node
link, which flashflex never does). The best few candidates by the fast score are refined
(`refine.refine`: whole-group and device-level moves), and the finalists are ranked by `cost.estimate.estimate` alone.

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

import math
import time
from typing import Any

from ..cost.estimate import estimate
from ..cost.params import CostParams
from ..errors import InfeasibleError, InputError
from ..hardware.cluster import Cluster
from ..model.spec import ModelSpec
from ..plan.schema import Plan, TrainConfig
from ..units import byte_size
from .batch import micro_batches
from .candidates import Candidate, build_plan, score
from .fastcost import CostCache
from .feasibility import check_feasible, model_state_bytes
from .graph import DeviceGraph
from .microbatch import MicroBatchSearch
from .partition import device_subsets, generators
from .pool import SearchPool
from .refine import refine
from .stages import best_pipeline

STRATEGIES = ("flashflex", "uniform", "exhaustive")
FINALISTS = 6
REFINED = 2
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
    return ks


def _collect(pool: SearchPool, total_micro: int, seed: int, deadline: float, stats: SearchStats,
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
    if _merge(cache, units, pool.map(_unit, units), found, stats):
        return found
    tail = [(total_micro, seed, k, full, deadline, True) for k in ks[len(sure):]]
    for start in range(0, len(tail), TAIL_BATCH):
        units = tail[start:start + TAIL_BATCH]
        before = min((c.score_s for c in found), default=float("inf"))
        seen = {c.signature() for c in found}
        count = len(found)
        if _merge(cache, units, pool.map(_unit, units), found, stats):
            return found
        # (a partition repeated at a larger k, e.g. striped past the devices per node, is not news)
        best = min((c.score_s for c in found[count:] if c.signature() not in seen), default=float("inf"))
        if not every_k and best >= TAIL_STOP * before:
            break
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
    _merge(cache, units, pool.map(_unit, units), found, stats)
    return found


def _unit(cache: CostCache, item: tuple[int, int, int, tuple[int, ...], float, bool]
          ) -> tuple[list[Candidate], int, bool]:
    """One unit of `_collect`: (candidates, how many were scored, whether the deadline had passed)."""
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
            cands, count, _ = _unit(cache, (*unit[:-1], False))
        found.extend(cands)
        stats.candidates += count
    return False


def _refine_unit(cache: CostCache, item: tuple[Candidate, int, int, float, bool]
                 ) -> tuple[Candidate, dict[int, str]] | None:
    """`refine` of one candidate; None when the deadline had passed before it started."""
    cand, total_micro, seed, deadline, device_moves = item
    if time.monotonic() >= deadline:
        return None
    return refine(cache, cand, total_micro, seed, deadline, device_moves=device_moves)


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


def _uniform_seeds(cache: CostCache, total_micro: int) -> tuple[list[Candidate], list[Candidate]]:
    """The uniform baseline's best layouts: (re-split by our layer and batch splits, exactly as uniform);
    layouts with a TP group across two fast-link islands are left out."""
    from .pipeline import PipeEval, evaluate_pipeline
    from .uniform import equal_layers, uniform_layouts

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


def _ranked(cands: list[Candidate]) -> list[Candidate]:
    unique: dict[tuple, Candidate] = {}
    for cand in cands:
        unique.setdefault(cand.signature(), cand)
    return sorted(unique.values(), key=lambda c: (c.score_s, c.signature()))


def finalise(cache: CostCache, cands: list[Candidate], strategy: str, seed: int,
             reasons: dict[int, dict[int, str]] | None = None, limit: int = FINALISTS,
             stats: SearchStats | None = None, always: list[Candidate] | None = None) -> Plan:
    """Rank the best `limit` candidates (and every one of `always`) by `estimate`, fitting plans only,
    and return the best Plan."""
    g = cache.graph
    best: tuple[float, int, Candidate, Any] | None = None
    ranked = _ranked(cands)
    must = {c.signature() for c in always or []}
    ranked += [c for c in _ranked(always or []) if c.signature() not in {r.signature() for r in ranked}]
    for index, cand in enumerate(ranked):
        if index >= limit and best is not None and cand.signature() not in must:
            continue
        plan = build_plan(cache, cand, strategy, seed, predict=False)
        est = estimate(plan, g.cluster, cache.params)
        if stats is not None:
            stats.estimated += 1
        if est.fits and (best is None or (est.iteration_time_s, index) < best[:2]):
            best = (est.iteration_time_s, index, cand, est)
    if best is None:
        raise _nothing_fits(cache)
    _, _, cand, est = best
    why = _idle_reasons(cache, cand, ranked)
    why.update({g.ids[i]: text for i, text in (reasons or {}).get(id(cand), {}).items()})
    why.update(_unused_reasons(cache, cand))
    plan = build_plan(cache, cand, strategy, seed, why, predict=False)
    return plan.model_copy(update={"predicted": est.to_predicted()})


def _idle_reasons(cache: CostCache, cand: Candidate, pool: list[Candidate]) -> dict[str, str]:
    """For each idle device: how much slower the best layout found that uses it is (fast model)."""
    g = cache.graph
    out: dict[str, str] = {}
    for i in range(g.size):
        if i in cand.used:
            continue
        using = min((c.score_s for c in pool if i in c.used), default=None)
        if using is None:
            out[g.ids[i]] = "no layout found uses it: the batch, memory or its speed leave it no useful place"
        elif using > cand.score_s:
            out[g.ids[i]] = (f"leaving it idle is {(using - cand.score_s) / using * 100:.1f}% faster than the "
                             f"best layout found that uses it")
    return out


def _unused_reasons(cache: CostCache, cand: Candidate) -> dict[str, str]:
    """'too small' reasons for idle devices that cannot hold one layer even at their node's largest TP."""
    g = cache.graph
    out: dict[str, str] = {}
    used = cand.used
    reserve = cache.params.memory_reserve_bytes
    for i in range(g.size):
        if i in used:
            continue
        cap = cache.capacity((i,))
        if cache.max_layers(1, False, False, 1, cap) < 1:
            need = cache.stage_bytes(1, 1, False, False, 1) - reserve
            out[g.ids[i]] = (f"too small: {byte_size(cap - reserve)} cannot hold one layer's state "
                             f"(needs {byte_size(need)})")
    return out


def _nothing_fits(cache: CostCache) -> InfeasibleError:
    model, g, train = cache.model, cache.graph, cache.train
    fitting = [pipe.num_stages for pipe in cache.pipe_memo.values() if pipe.ok]  # type: ignore[attr-defined]
    total = train.global_batch // train.micro_batch_size
    if fitting and min(fitting) > total:
        need = min(fitting)
        return InfeasibleError(
            f"global batch {train.global_batch} gives {total} micro-batches of {train.micro_batch_size}, but the "
            f"smallest pipeline of {model.name} that fits in memory has {need} stages and 1F1B needs a "
            f"micro-batch per stage; use a global batch of at least {need * train.micro_batch_size}"
        )
    need = model_state_bytes(cache)
    have = sum(cache.capacity((i,)) - cache.params.memory_reserve_bytes for i in range(g.size))
    return InfeasibleError(
        f"no layout of {model.name} fits in memory: weights, gradients and optimizer state need "
        f"{byte_size(need)} plus activations for seq_len {cache.train.seq_len}; the cluster has "
        f"{byte_size(have)} usable; add devices, enable --recompute or lower --micro-batch"
    )


def plan_layout(cluster: Cluster, model: ModelSpec, train: TrainConfig, strategy: str = "flashflex",
                time_budget_s: float = 30.0, seed: int = 0, params: CostParams | None = None,
                stats: SearchStats | None = None, device_moves: bool = True,
                max_micro_batch: int | None = None, jobs: int = 1) -> Plan:
    """Plan an asymmetric layout of `model` on `cluster` for `train` (module docstring); InfeasibleError
    when none exists; InputError for an unknown strategy. `device_moves=False` limits refinement to
    whole-group moves (to measure what the device-level moves add). `max_micro_batch`: None pins every
    pipeline's micro-batch size to train.micro_batch_size; a number lets the flashflex strategy choose each
    pipeline's size among train.micro_batch_size x 2^j up to it (`microbatch.MicroBatchSearch`). `jobs`:
    worker processes for the search's independent units (`pool.SearchPool`; the plan does not depend on it)."""
    if strategy not in STRATEGIES:
        raise InputError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if max_micro_batch is not None and max_micro_batch < 1:
        raise InputError(f"--max-micro-batch must be at least 1, got {max_micro_batch}")
    started = time.monotonic()
    stats = stats if stats is not None else SearchStats()
    params = params or CostParams()
    total = micro_batches(train.global_batch, train.micro_batch_size)
    cache = CostCache(DeviceGraph(cluster, train.dtype), model, train, params)
    check_feasible(cache, total)
    deadline = started + max(0.0, time_budget_s)
    if strategy == "uniform":
        from .uniform import best_uniform

        plan = best_uniform(cache, total, seed)
    elif strategy == "exhaustive":
        from .exhaustive import exhaustive_candidates

        cut = [False]
        cands = exhaustive_candidates(cache, total, deadline, cut)
        stats.budget_hit = cut[0]
        if not cands:
            raise _nothing_fits(cache)
        plan = finalise(cache, cands, strategy, seed, stats=stats, limit=2 * FINALISTS)
    else:
        resplit, exact = _uniform_seeds(cache, total)
        reasons: dict[int, dict[int, str]] = {}
        refined = []
        with SearchPool(cache, jobs) as pool:
            cands = _ranked(_collect(pool, total, seed, deadline, stats) + resplit)
            units = [(cand, total, seed, deadline, device_moves) for cand in cands[:REFINED]]
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
        plan = finalise(cache, refined + cands, strategy, seed, reasons, stats=stats, always=exact + tuned)
    stats.seconds = time.monotonic() - started
    return plan


def scored_candidates(cluster: Cluster, model: ModelSpec, train: TrainConfig, seed: int = 0,
                      params: CostParams | None = None) -> tuple[CostCache, list[Candidate]]:
    """Every candidate the flashflex strategy's search scores before refinement (both phases and the uniform
    seeds), ranked by fast score, with the cache that scored them: for benchmarks and diagnostics of the fast
    score against `cost.estimate` (no time budget, one process)."""
    params = params or CostParams()
    total = micro_batches(train.global_batch, train.micro_batch_size)
    cache = CostCache(DeviceGraph(cluster, train.dtype), model, train, params)
    check_feasible(cache, total)
    resplit, _ = _uniform_seeds(cache, total)
    with SearchPool(cache, 1) as pool:
        found = _collect(pool, total, seed, float("inf"), SearchStats(), every_k=True)
    return cache, _ranked(found + resplit)

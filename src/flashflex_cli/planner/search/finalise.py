"""The search's last step: the best candidates by fast score, ranked by the cost model alone.

`finalise` builds the best `FINALISTS` candidates (and every one the caller insists on) as `Plan`s, ranks them by
`cost.estimate.estimate` (fitting plans only) and returns the best, with the reasons its idle devices are idle:
how much slower the best layout found that uses a device is, or that it is too small to hold one layer.
"""

from __future__ import annotations

from typing import Any

from ...cost.estimate import estimate
from ...errors import InfeasibleError
from ...plan.schema import Plan
from ...units import byte_size
from ..scoring.candidate import Candidate, build_plan
from ..scoring.cost_cache import CostCache
from ..scoring.feasibility import model_state_bytes
from ..scoring.pipeline_score import evaluated
from .collect import SearchStats

FINALISTS = 6


def ranked_unique(cands: list[Candidate]) -> list[Candidate]:
    """`cands` without repeated layouts, by (fast score, signature)."""
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
    ranked = ranked_unique(cands)
    must = {c.signature() for c in always or []}
    ranked += [c for c in ranked_unique(always or []) if c.signature() not in {r.signature() for r in ranked}]
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
        raise nothing_fits(cache)
    _, _, cand, est = best
    why = _idle_reasons(cache, cand, ranked)
    why.update({g.ids[i]: text for i, text in (reasons or {}).get(id(cand), {}).items()})
    why.update(_unused_reasons(cache, cand))
    plan = build_plan(cache, cand, strategy, seed, why, predict=False)
    return plan.model_copy(update={"predicted": est.prediction()})


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


def nothing_fits(cache: CostCache) -> InfeasibleError:
    """Why no layout was found: the batch too small for the shortest pipeline that fits, or memory."""
    model, g, train = cache.model, cache.graph, cache.train
    fitting = [pipe.num_stages for pipe in evaluated(cache) if pipe.ok]
    mbs = cache.micro_batch
    total = train.global_batch // mbs
    if fitting and min(fitting) > total:
        need = min(fitting)
        return InfeasibleError(
            f"global batch {train.global_batch} gives {total} micro-batches of {mbs}, but the "
            f"smallest pipeline of {model.name} that fits in memory has {need} stages and 1F1B needs a "
            f"micro-batch per stage; use a global batch of at least {need * mbs}"
        )
    need = model_state_bytes(cache)
    have = sum(cache.capacity((i,)) - cache.params.memory_reserve_bytes for i in range(g.size))
    return InfeasibleError(
        f"no layout of {model.name} fits in memory: weights, gradients and optimizer state need "
        f"{byte_size(need)} plus activations for seq_len {cache.train.seq_len}; the cluster has "
        f"{byte_size(have)} usable; add devices, enable --recompute or lower --micro-batch"
    )

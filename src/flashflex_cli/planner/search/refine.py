"""Refinement moves on a candidate: drop a stage, move a stage to another pipeline, swap two stages,
and, at device level (`device_moves`), shed devices of a TP group into another pipeline or swap two
devices between groups of different pipelines.

Whole-group moves keep the level-2 rules (a group inside one node and one fast-link island, a supported
degree) by construction; the device-level moves check them. Whole-group moves are tried first, the
device-level ones after them (generated lazily, so they cost nothing when a group move helps). Every
move re-splits the layers of the pipelines it touches and the batch over all pipelines; the first move
that lowers the fast score is taken, in a fixed order (shuffled by the seed), until no move helps,
`max_moves` moves were taken, `max_trials` moves were evaluated (a deterministic cap, shared by both
kinds of move), or the deadline passes. A dropped stage's devices go unused, with the gain recorded as
the reason.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import numpy as np

from ..scoring.candidate import Candidate, score
from ..scoring.cost_cache import CostCache, Devs
from ..scoring.pipeline_score import evaluate_pipeline
from .device_moves import place, shed_moves, swap_moves


def refine(cache: CostCache, cand: Candidate, total_micro: int, seed: int, deadline: float,
           max_moves: int = 32, max_pairs: int = 3, max_trials: int = 1500,
           device_moves: bool = True) -> tuple[Candidate, dict[int, str]]:
    """Improve `cand` by local moves; returns the result and reasons for devices it dropped.

    Work is capped by `max_trials` move evaluations (deterministic) and, as a safety net, by `deadline`
    (seconds of `time.monotonic()`). `device_moves=False` keeps to whole-group moves (for comparisons).
    """
    rng = np.random.default_rng(seed)
    reasons: dict[int, str] = {}
    moves = 0
    budget = [max_trials]
    while moves < max_moves and budget[0] > 0 and time.monotonic() < deadline:
        found = _first_improvement(cache, cand, total_micro, rng, deadline, max_pairs, budget, device_moves)
        if found is None:
            break
        better, dropped = found
        gain = (cand.score_s - better.score_s) / cand.score_s * 100
        for i in dropped:
            reasons[i] = f"dropping it is {gain:.1f}% faster (predicted by the planner's fast model)"
        cand = better
        moves += 1
    for i in list(reasons):
        if i in cand.used:
            del reasons[i]
    return cand, reasons


def _first_improvement(cache: CostCache, cand: Candidate, total_micro: int, rng: np.random.Generator,
                       deadline: float, max_pairs: int, budget: list[int],
                       device_moves: bool) -> tuple[Candidate, tuple[int, ...]] | None:
    pipes = list(cand.pipes)
    count = len(pipes)
    order = [int(p) for p in rng.permutation(count)]
    best_known = cand.score_s

    def trial(changes: dict[int, tuple[Devs, ...]]) -> Candidate | None:
        new = []
        for p in range(count):
            if p in changes:
                if changes[p]:
                    new.append(evaluate_pipeline(cache, changes[p]))
            else:
                new.append(pipes[p])
        bound = best_known * (1 - 1e-9)
        result = score(cache, new, total_micro, bound)  # None when it cannot beat the bound
        if result is not None and result.score_s < bound:
            return result
        return None

    def group_level() -> Iterator[Callable[[], tuple[Candidate | None, tuple[int, ...]]]]:
        # generated lazily (in a fixed order): a move found early costs nothing for the moves after it
        for p in order:
            stages = pipes[p].stages
            for s in range(len(stages)):
                rest = stages[:s] + stages[s + 1:]
                if rest or count > 1:
                    yield lambda p=p, rest=rest, gone=stages[s]: (trial({p: rest}), gone)
            partners = [q for q in order if q != p][:max_pairs]
            for q in partners:
                for s in range(len(stages)):
                    rest = stages[:s] + stages[s + 1:]
                    moved = place(cache, pipes[q].stages, stages[s])
                    yield lambda p=p, q=q, rest=rest, moved=moved: (trial({p: rest, q: moved}), ())
                    for t, other in enumerate(pipes[q].stages):
                        if other == stages[s] or len(other) != len(stages[s]):
                            continue
                        if cache.stage_key(other) == cache.stage_key(stages[s]):
                            continue  # swapping equal groups changes nothing
                        mine = place(cache, rest, other)
                        theirs = place(cache, pipes[q].stages[:t] + pipes[q].stages[t + 1:], stages[s])
                        yield lambda p=p, q=q, mine=mine, theirs=theirs: (trial({p: mine, q: theirs}), ())

    def device_level() -> Iterator[Callable[[], tuple[Candidate | None, tuple[int, ...]]]]:
        stages = [pipe.stages for pipe in pipes]
        for p in order:
            partners = [q for q in order if q != p][:max_pairs]
            for changes in itertools.chain(shed_moves(cache, stages, p, partners),
                                           swap_moves(cache, stages, p, partners)):
                yield lambda changes=changes: (trial(changes), ())

    every: Iterator[Callable[[], tuple[Candidate | None, tuple[int, ...]]]] = group_level()
    if device_moves and count > 1:
        every = itertools.chain(group_level(), device_level())
    for attempt in every:
        if budget[0] <= 0 or time.monotonic() >= deadline:
            return None
        budget[0] -= 1
        result, gone = attempt()
        if result is not None:
            return result, tuple(gone)
    return None

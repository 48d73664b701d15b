"""Exact lower bounds on a pipeline's amortised time, to skip structures that cannot win.

The structure search (`stage_search`) only takes a trial structure whose seconds per micro-batch
(`trials.amortised`: the closed form (fill + (m - 1) pace) / m, m = max(micro, S)) are strictly below the best so far.
The bounds here are values the exact figure is never below, from per-layer stage times and transfer times
alone (no memory caps, no layer split, no window search), so a trial whose bound already reaches the best so
far is skipped without changing the search's result. Every stage holds at least one layer (n_s >= 1), and
u_s = t_s + e_s (t_s: one layer's seconds, e_s: embedding / head seconds on the first / last stage), hence:

- pace >= u_s for every stage, and every window of stages is at least its value with one layer per stage
  (`cost.schedule.steady_period_s`): adjacent pairs (u_s + u_{s+1} + 2 p_s) / 2, and the whole pipeline
  fill / S;
- pace >= the continuous relaxation of the min-max split: T with sum_s (T - e_s) / t_s = L;
- fill >= sum_s u_s + (L - S) t_min + 2 sum_s p_s: the L - S layers beyond one per stage cost at least
  the fastest stage's per-layer time.
A pipeline with more stages than layers or than `max_stages` gets inf, its exact figure. `Summary` holds a
run of consecutive stages (a node block cut into TP groups) so that a trial structure, a sequence of such
runs, is bounded in O(runs) instead of O(stages). All times in seconds per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...cost.schedule import closed_form_s, pair_window_s

INFEASIBLE = float("inf")
SAFETY = 1e-9  # relative margin over floating-point rounding: prune only when clearly not better


@dataclass(frozen=True)
class Summary:
    """A run of consecutive stages: count, per-layer seconds of its first and last stage, sum of 1 / t,
    sum, least and greatest t, largest adjacent-pair window inside it (e left out), sum of its links."""

    count: int
    first_t: float
    last_t: float
    inverse: float
    total: float
    fastest: float
    slowest: float
    pair: float
    hops: float

    @classmethod
    def of(cls, per_layer: Sequence[float], links: Sequence[float]) -> Summary:
        """The summary of stages with per-layer seconds `per_layer` and links[s] from stage s to s + 1."""
        pair = max((pair_window_s(per_layer[s], per_layer[s + 1], p) for s, p in enumerate(links)),
                   default=0.0)
        return cls(len(per_layer), per_layer[0], per_layer[-1], sum(1.0 / t for t in per_layer),
                   sum(per_layer), min(per_layer), max(per_layer), pair, sum(links))


def runs_lower_bound(runs: Sequence[Summary], joins: Sequence[float], embed_s: float, head_s: float,
                     num_layers: int, micro: int, max_stages: int) -> float:
    """Lower bound on the amortised seconds of the pipeline made of `runs` in order, joins[i] the transfer
    seconds from run i to run i + 1, `embed_s` on its first stage and `head_s` on its last."""
    count, inverse, total, hops = 0, 0.0, 0.0, 0.0
    pace, fastest = 0.0, float("inf")
    for run in runs:
        count += run.count
        inverse += run.inverse
        total += run.total
        hops += run.hops
        if run.slowest > pace:
            pace = run.slowest
        if run.pair > pace:
            pace = run.pair
        if run.fastest < fastest:
            fastest = run.fastest
    if count == 0 or count > max_stages or count > num_layers:
        return INFEASIBLE
    first, last = runs[0], runs[-1]
    for i, p in enumerate(joins):
        hops += p
        pair = pair_window_s(runs[i].last_t, runs[i + 1].first_t, p)
        if pair > pace:
            pace = pair
    return combine(count, first.first_t, last.last_t, inverse, total, fastest, pace, hops, embed_s, head_s,
                    num_layers, micro)


def stages_lower_bound(per_layer: Sequence[float], links: Sequence[float], embed_s: float, head_s: float,
                       num_layers: int, micro: int, max_stages: int) -> float:
    """`runs_lower_bound` of single stages: per_layer[s] per stage, links[s] from stage s to s + 1."""
    count = len(per_layer)
    if count == 0 or count > max_stages or count > num_layers:
        return INFEASIBLE
    pace = max(per_layer)
    hops = 0.0
    for s, p in enumerate(links):
        hops += p
        pair = pair_window_s(per_layer[s], per_layer[s + 1], p)
        if pair > pace:
            pace = pair
    return combine(count, per_layer[0], per_layer[-1], sum([1.0 / t for t in per_layer]), sum(per_layer),
                    min(per_layer), pace, hops, embed_s, head_s, num_layers, micro)


def combine(count: int, first_t: float, last_t: float, inverse: float, total: float, fastest: float, pace: float,
             hops: float, embed_s: float, head_s: float, num_layers: int, micro: int) -> float:
    """The bound from a pipeline's totals (see module docstring); `pace`: its windows' bound so far."""
    if count == 1:
        pace = max(pace, first_t + embed_s + head_s)
    else:
        pace = max(pace, first_t + embed_s, last_t + head_s)
    pace = max(pace, (num_layers + embed_s / first_t + head_s / last_t) / inverse)
    fill = total + embed_s + head_s + (num_layers - count) * fastest + 2.0 * hops
    pace = max(pace, fill / count)
    m = max(micro, count)
    return closed_form_s(pace, fill, m) / m


def cannot_beat(bound: float, bar: float) -> bool:
    """True when a structure with lower bound `bound` cannot be strictly below `bar` (both seconds)."""
    return bound * (1.0 - SAFETY) >= bar

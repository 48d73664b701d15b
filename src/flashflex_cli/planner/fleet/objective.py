"""Objectives beyond tokens/s, searched from the outside: re-plan reduced clusters, compare the plans.

A reduced cluster is the cluster without some nodes (`reduced`). Nodes of identical hardware (same devices,
fabric and NIC) form a node class; inside a class the first nodes in file order are kept, so a reduced cluster is
a count per class, and the search space is the product of the classes'
counts, small next to the number of devices. Every reduced cluster is planned by the caller's planner
(`plan_layout` with the command's options), so each figure compared is the cost model's.

- `throughput`: most tokens/s. Without a budget the whole (allowed) cluster is planned once; the planner
  already leaves devices idle when that is faster.
- `cost`: least dollars per token: price per hour of the devices the plan uses / tokens/s (idle devices
  of the reduced cluster are not charged; nodes left out are not rented).
- `budget` (currency units per hour of the devices used): plans above it lose to every plan within it;
  among those within it, the objective decides.

Search: every count vector when there are at most `EXHAUSTIVE_LIMIT` of them, else greedy elimination
from the whole cluster (drop one node of the class whose removal improves the objective most, until no
removal improves it). Deterministic: fixed orders, ties broken on the kept nodes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ...errors import FlashflexError, InfeasibleError, InputError
from ...hardware.cluster import Cluster
from ...plan.schema import Plan
from .pricing import DevicePrices, per_million_tokens
from .reduced import NodeClass, node_classes, on_full_cluster, parse_exclude, reduced_cluster

OBJECTIVES = ("throughput", "cost")
EXHAUSTIVE_LIMIT = 15  # reduced clusters planned one by one when the count vectors are at most this many

PlanFn = Callable[[Cluster], Plan]  # plans a (reduced) cluster; raises a FlashflexError when nothing fits


@dataclass(frozen=True)
class Trial:
    """One reduced cluster (the nodes kept, file order) and its plan, or why it has none."""

    kept: tuple[str, ...]
    plan: Plan | None
    error: str = ""
    tokens_per_s: float = 0.0
    per_hour: float | None = None  # currency units per hour of the devices the plan uses

    @property
    def per_million_tokens(self) -> float | None:
        """Currency units per million tokens over the devices used (None without prices)."""
        return None if self.per_hour is None else per_million_tokens(self.per_hour, self.tokens_per_s)


@dataclass
class Search:
    """Plans reduced clusters on demand, once each (memoised by the nodes kept)."""

    cluster: Cluster
    plan_fn: PlanFn
    prices: DevicePrices | None = None
    trials: dict[tuple[str, ...], Trial] = field(default_factory=dict)

    def trial(self, kept: Sequence[str]) -> Trial:
        """The plan of the cluster with only the nodes `kept`."""
        key = tuple(n.name for n in self.cluster.nodes if n.name in set(kept))
        found = self.trials.get(key)
        if found is not None:
            return found
        try:
            plan = self.plan_fn(reduced_cluster(self.cluster, key))
        except FlashflexError as exc:
            found = Trial(key, None, str(exc))
        else:
            tokens = float(plan.predicted.tokens_per_s) if plan.predicted else 0.0
            fits = (plan.predicted is None or plan.predicted.fits_memory) and math.isfinite(tokens) and tokens > 0
            hourly = None if self.prices is None else self.prices.hourly(r.device for r in plan.ranks())
            found = Trial(key, plan if fits else None, "" if fits else "the plan found does not fit",
                          tokens if fits else 0.0, hourly)
        self.trials[key] = found
        return found


def _key(trial: Trial, objective: str, budget: float | None) -> tuple:
    """Smaller is better: runnable first, then within budget, then the objective, then fewer nodes."""
    if trial.plan is None:
        return (2, 0.0, 0.0, len(trial.kept), trial.kept)
    over = max(0.0, (trial.per_hour or 0.0) - budget) if budget is not None else 0.0
    if over > 0:
        return (1, over, -trial.tokens_per_s, len(trial.kept), trial.kept)
    if objective == "cost":
        return (0, trial.per_million_tokens, -trial.tokens_per_s, len(trial.kept), trial.kept)
    return (0, -trial.tokens_per_s, trial.per_hour or 0.0, len(trial.kept), trial.kept)


def _kept(classes: Sequence[NodeClass], counts: Sequence[int]) -> tuple[str, ...]:
    return tuple(n for cls, c in zip(classes, counts, strict=True) for n in cls.nodes[:c])


@dataclass(frozen=True)
class Choice:
    """The chosen trial, the trial of every allowed node, and how the choice was searched."""

    best: Trial
    full: Trial
    method: str


def choose(search: Search, allowed: Sequence[str], objective: str = "throughput",
           budget: float | None = None) -> Choice:
    """The best reduced cluster of the `allowed` nodes for `objective` within `budget` (module docstring).
    InfeasibleError when nothing can run, or nothing within the budget."""
    if objective not in OBJECTIVES:
        raise InputError(f"--objective: unknown {objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if (objective == "cost" or budget is not None) and search.prices is None:
        raise InputError(f"{'--objective cost' if objective == 'cost' else '--budget'} needs --prices FILE")
    classes = node_classes(search.cluster, allowed)
    full = search.trial(_kept(classes, [len(c.nodes) for c in classes]))
    method = "whole cluster"
    best = full
    if objective == "cost" or (budget is not None and (full.plan is None or (full.per_hour or 0.0) > budget)):
        vectors = list(itertools.product(*(range(len(c.nodes), -1, -1) for c in classes)))
        vectors = [v for v in vectors if any(v)]
        if len(vectors) <= EXHAUSTIVE_LIMIT:
            method = f"every one of {len(vectors)} reduced clusters"
            best = min((search.trial(_kept(classes, v)) for v in vectors), key=lambda t: _key(t, objective, budget))
        else:
            best, steps = _greedy(search, classes, objective, budget)
            method = f"greedy elimination, {steps} steps, {len(search.trials)} reduced clusters planned"
    if best.plan is None:
        raise InfeasibleError(f"no plan found on any reduced cluster: {full.error or 'nothing fits'}")
    if budget is not None and (best.per_hour or 0.0) > budget:
        raise InfeasibleError(f"no plan found within --budget {budget:g}/h: the cheapest that runs costs "
                              f"{best.per_hour:,.2f}/h ({len(best.kept)} nodes)")
    return Choice(best, full, method)


def _greedy(search: Search, classes: Sequence[NodeClass], objective: str,
            budget: float | None) -> tuple[Trial, int]:
    counts = [len(c.nodes) for c in classes]
    current = search.trial(_kept(classes, counts))
    steps = 0
    while True:
        moves = []
        for i, c in enumerate(counts):
            if c == 0 or sum(counts) == 1:
                continue
            trial_counts = list(counts)
            trial_counts[i] -= 1
            moves.append((search.trial(_kept(classes, trial_counts)), trial_counts))
        if not moves:
            return current, steps
        trial, trial_counts = min(moves, key=lambda m: _key(m[0], objective, budget))
        if _key(trial, objective, budget) >= _key(current, objective, budget):
            return current, steps
        current, counts, steps = trial, trial_counts, steps + 1


def left_out_reasons(search: Search, choice: Choice, objective: str, budget: float | None,
                     currency: str = "") -> dict[str, str]:
    """For every allowed node the chosen plan's reduced cluster leaves out: the measured comparison."""
    best = choice.best
    out: dict[str, str] = {}
    rule = f"--objective {objective}" + (f" --budget {budget:g}" if budget is not None else "")
    for name in choice.full.kept:
        if name in best.kept:
            continue
        using = [t for t in search.trials.values() if t.plan is not None and name in t.kept]
        other = min(using, key=lambda t: _key(t, objective, budget)) if using else None
        text = f"left out by {rule}: the plan without it: {_figures(best, currency)}"
        if other is not None:
            text += f"; the best plan found with it: {_figures(other, currency)}"
        out[name] = text
    return out


def _figures(trial: Trial, currency: str) -> str:
    text = f"{trial.tokens_per_s:,.0f} tokens/s"
    if trial.per_hour is not None:
        text += f", {currency} {trial.per_hour:,.2f}/h, {currency} {trial.per_million_tokens:,.4g}/M tokens"
    return text


@dataclass(frozen=True)
class Marginal:
    """What one node group is worth: the plan with it against the plan without it (one of them re-planned),
    or only a note (a group the plan leaves idle)."""

    label: str
    nodes: tuple[str, ...]
    with_it: Trial
    without: Trial
    note: str = ""
    per_hour: float | None = None  # what the group's devices used by the plan with it cost per hour

    @property
    def tokens_per_s(self) -> float:
        """Tokens/s the group adds."""
        return self.with_it.tokens_per_s - self.without.tokens_per_s


def explain(search: Search, base: Trial, allowed: Sequence[str] | None = None) -> list[Marginal]:
    """For each node class of `base`'s nodes: drop one node (the last of the class that `base` uses) and,
    when the class has more than one node used, all of them; re-plan and compare. Nodes `base` leaves idle
    whole get a note without re-planning (dropping them changes nothing). For each class of the `allowed`
    nodes that `base` left out: add its first node left out, re-plan and compare."""
    if base.plan is None:
        return []
    used_nodes = {search.cluster.node_of(r.device) for r in base.plan.ranks()}
    out: list[Marginal] = []
    for cls in node_classes(search.cluster, base.kept):
        used = [n for n in cls.nodes if n in used_nodes]
        idle = [n for n in cls.nodes if n not in used_nodes]
        if idle:
            label = f"{_span(idle)} ({cls.label}{' each' if len(idle) > 1 else ''}, idle)"
            out.append(Marginal(label, tuple(idle), base, base, "idle in this plan: dropping it changes nothing"))
        drops = [[used[-1]]] if used else []
        if len(used) > 1:
            drops.append(used)
        for drop in drops:
            kept = [n for n in base.kept if n not in drop]
            label = f"{_span(drop)} ({cls.label}{' each' if len(drop) > 1 else ''})"
            without = search.trial(kept) if kept else Trial((), None, "no node left")
            out.append(Marginal(label, tuple(drop), base, without, per_hour=_group_hourly(search, base, drop)))
    left_out = [n for n in (allowed or ()) if n not in base.kept]
    for cls in node_classes(search.cluster, left_out):
        node = cls.nodes[0]
        label = f"{node} ({cls.label}, left out{f'; {len(cls.nodes)} such nodes' if len(cls.nodes) > 1 else ''})"
        with_it = search.trial([*base.kept, node])
        out.append(Marginal(label, (node,), with_it, base, per_hour=_group_hourly(search, with_it, [node])))
    return out


def _group_hourly(search: Search, trial: Trial, nodes: Sequence[str]) -> float | None:
    """Cost per hour of the devices on `nodes` that `trial`'s plan uses (None without prices or a plan)."""
    if search.prices is None or trial.plan is None:
        return None
    return search.prices.hourly(r.device for r in trial.plan.ranks() if search.cluster.node_of(r.device) in nodes)


def _span(nodes: Sequence[str]) -> str:
    return nodes[0] if len(nodes) == 1 else f"{len(nodes)} nodes {nodes[0]}..{nodes[-1]}"


def marginal_line(m: Marginal, currency: str = "") -> str:
    """One line for humans: what the group adds in tokens/s and costs, and whether it pays for itself (the
    plan with it costs no more per token than the plan without it)."""
    if m.note:
        return f"{m.label}: {m.note}"
    if m.with_it.plan is None:
        return f"{m.label}: no plan with it ({m.with_it.error})"
    money = m.per_hour
    label = m.label + (f", {currency} {money:,.2f}/h" if money is not None else "")
    if m.without.plan is None:
        return f"{label}: the plan needs it: without it, {m.without.error}"
    share = m.tokens_per_s / m.without.tokens_per_s * 100
    if m.tokens_per_s < 0:  # the plan with it is slower: the search with it missed the layout without it
        text = (f"{label}: the plan without it is faster by {-m.tokens_per_s:,.0f} tokens/s ({-share:.1f}%): the "
                f"search missed it (plan with --exclude {','.join(m.nodes)}, or a larger --time-budget)")
    else:
        text = f"{label}: adds {m.tokens_per_s:,.0f} tokens/s ({share:+.1f}% over the plan without it)"
    with_it, without = m.with_it.per_million_tokens, m.without.per_million_tokens
    if with_it is not None and without is not None:
        verdict = "pays for itself" if with_it <= without else "does not pay for itself"
        text += f"; {currency} {with_it:,.4g}/M tokens with it, {without:,.4g} without: {verdict}"
    return text


__all__ = ["EXHAUSTIVE_LIMIT", "OBJECTIVES", "Choice", "Marginal", "NodeClass", "PlanFn", "Search", "Trial", "choose",
           "explain", "left_out_reasons", "marginal_line", "node_classes", "on_full_cluster", "parse_exclude",
           "reduced_cluster"]

"""`flashflex plan`'s fleet options: --prices, --objective, --budget, --exclude, --explain (and `show`/`diff`
--prices). Thin glue between the command and planner/fleet/ (objective.py, idle_measure.py,
economics.py); the command passes its planner as a function of the cluster to plan."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from .. import validate_numbers
from ..cost.params import CostParams
from ..errors import InfeasibleError, InputError
from ..hardware.cluster import Cluster
from ..plan.schema import Plan
from ..planner.fleet.economics import annotated
from ..planner.fleet.idle_groups import with_measured_reasons
from ..planner.fleet.idle_measure import measure_idle
from ..planner.fleet.objective import (
    OBJECTIVES,
    Choice,
    PlanFn,
    Search,
    choose,
    explain,
    left_out_reasons,
    marginal_line,
    on_full_cluster,
    parse_exclude,
    reduced_cluster,
)
from ..planner.fleet.pricing import DevicePrices, load_prices, prices_for

PRICES_HELP = "Prices per device-hour by device type (flashflex.prices/1; see prices/example.json)."
EXCLUDED = "excluded with --exclude"


def device_prices(path: Path | None, cluster: Cluster) -> DevicePrices | None:
    """The prices of `cluster`'s devices from a prices file (None without one); bad files are InputErrors."""
    if path is None:
        return None
    prices, sha = load_prices(path)
    return prices_for(prices, cluster, str(path), sha)


@dataclass
class Fleet:
    """The fleet options of one `flashflex plan`, checked, and what the objective search chose."""

    cluster: Cluster
    prices: DevicePrices | None
    objective: str = "throughput"
    budget: float | None = None
    excluded: list[str] = field(default_factory=list)
    search: Search | None = None
    choice: Choice | None = None
    seconds: float = 0.0

    @classmethod
    def from_options(cls, cluster: Cluster, prices_file: Path | None, objective: str, budget: float | None,
                     exclude: str | None) -> Fleet:
        """Check the options against `cluster` before any planning (one-line InputError on bad input)."""
        if objective not in OBJECTIVES:
            raise InputError(f"--objective: unknown {objective!r}; choose one of {', '.join(OBJECTIVES)}")
        if budget is not None:
            budget = validate_numbers.positive(budget, "--budget", 1e9)
        prices = device_prices(prices_file, cluster)
        if prices is None and (objective == "cost" or budget is not None):
            raise InputError(f"{'--objective cost' if objective == 'cost' else '--budget'} needs --prices FILE")
        return cls(cluster, prices, objective, budget, parse_exclude(cluster, exclude))

    @property
    def allowed(self) -> list[str]:
        """Node names the planner may use (all but --exclude), file order."""
        return [node.name for node in self.cluster.nodes if node.name not in self.excluded]

    @property
    def kept(self) -> list[str]:
        """Node names of the chosen plan's (reduced) cluster; the allowed nodes before `plan` has run."""
        return list(self.choice.best.kept) if self.choice is not None else self.allowed

    def baseline_cluster(self) -> Cluster:
        """The nodes the chosen plan was planned on (the uniform baseline is planned on the same ones)."""
        kept = self.kept
        return self.cluster if len(kept) == len(self.cluster.nodes) else reduced_cluster(self.cluster, kept)

    def plan(self, plan_fn: PlanFn) -> Plan:
        """The plan for the objective (re-planning reduced clusters where it needs to), as a plan of the whole
        cluster: nodes left out are listed unused with the measured reason."""
        started = time.monotonic()
        whole = tuple(node.name for node in self.cluster.nodes)

        def planner(sub: Cluster) -> Plan:  # the whole cluster is planned as loaded (the same object)
            return plan_fn(self.cluster if tuple(n.name for n in sub.nodes) == whole else sub)

        self.search = Search(self.cluster, planner, self.prices)
        try:
            self.choice = choose(self.search, self.allowed, self.objective, self.budget)
        except InfeasibleError:
            full = next(iter(self.search.trials.values()), None)
            if len(self.search.trials) == 1 and full is not None and full.error:
                raise InfeasibleError(full.error) from None  # one plan was asked for: its own message
            raise
        self.seconds = time.monotonic() - started
        reasons = {name: EXCLUDED for name in self.excluded}
        currency = self.prices.currency if self.prices is not None else ""
        reasons.update(left_out_reasons(self.search, self.choice, self.objective, self.budget, currency))
        assert self.choice.best.plan is not None  # choose() raises otherwise
        return on_full_cluster(self.choice.best.plan, self.cluster, reasons)

    def finish(self, plan: Plan, params: CostParams) -> Plan:
        """`plan` (re-estimated on the whole cluster) with a measured reason for each idle node group, the
        cluster-wide MFU basis and, with prices, its dollars."""
        groups = measure_idle(plan, self.cluster, params, self.prices)
        return annotated(with_measured_reasons(plan, groups), self.cluster, self.prices)

    def baseline(self, plan: Plan | None) -> Plan | None:
        """The uniform baseline (planned on `baseline_cluster()`) as a plan of the whole cluster, annotated."""
        if plan is None:
            return None
        reasons = {node.name: EXCLUDED if node.name in self.excluded else "left out: the baseline is planned on "
                   "the chosen plan's nodes" for node in self.cluster.nodes if node.name not in self.kept}
        return annotated(on_full_cluster(plan, self.cluster, reasons), self.cluster, self.prices)

    def render(self, console: Console, explain_groups: bool) -> None:
        """The objective search's summary line and, with --explain, one line per node group."""
        if self.choice is None or self.search is None:
            return
        best, currency = self.choice.best, self.prices.currency if self.prices is not None else ""
        if self.objective != "throughput" or self.budget is not None:
            rule = f"objective {self.objective}" + (f" within {currency} {self.budget:,.2f}/h" if self.budget else "")
            _say(console, f"  {rule}: kept {len(best.kept)} of {len(self.choice.full.kept)} nodes "
                          f"({self.choice.method}, {self.seconds:.1f} s)")
        if not explain_groups:
            return
        _say(console, "  node groups (each dropped, or added back, and re-planned: with it against without it):")
        for row in explain(self.search, best, self.allowed):
            _say(console, f"    {marginal_line(row, currency)}")


def _say(console: Console, text: str) -> None:
    """One line as it is: no markup (node names and errors are data), no wrapping by rich."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)

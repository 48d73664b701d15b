"""The search drivers: `plan_layout` (the planner's entry point, `driver`), its phases (`collect`, `refine`,
`finalise`), the micro-batch search, the `uniform` and `exhaustive` baselines and the worker pool."""

from .collect import SearchStats
from .driver import STRATEGIES, plan_layout, scored_candidates, searches_of

__all__ = ["STRATEGIES", "SearchStats", "plan_layout", "scored_candidates", "searches_of"]

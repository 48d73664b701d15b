"""The planner: from a cluster, a model and a training configuration to the best layout it finds, as a Plan.

Laid out by its levels; a subpackage imports only the ones above it in this list (and the cost model, `cost/`,
which it asks every figure):
- `space`: what a layout is made of, without costs: the device graph and its fast-link islands, level-1
  partitions into pipelines, TP groups, the exact layer and batch splits;
- `scoring`: the fast score, the cost model's figures memoised for thousands of candidates: device groups'
  costs (`cost_cache.CostCache`), pipelines (`pipeline_score`), the data-parallel term (`dp_score`), candidates
  (`candidate`), up-front feasibility;
- `structure`: level 2, the best stage structure of one pipeline's devices, searched best-first by exact lower
  bounds;
- `search`: the drivers: `plan_layout` (the entry point: `flashflex_cli.planner.search.plan_layout`) with its
  phases, refinement moves, the micro-batch search, the `uniform` and `exhaustive` baselines, the worker pool;
- `fleet`: what a plan means for the fleet, beside the search: reduced clusters and objectives (tokens/s,
  dollars), prices, idle devices measured, the training precision.
"""

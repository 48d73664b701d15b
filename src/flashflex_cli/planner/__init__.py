"""The planner: device graph, pymetis partitioning, layer and batch splits, search, baselines.

Entry point: `flashflex_cli.planner.search.plan_layout`.
"""

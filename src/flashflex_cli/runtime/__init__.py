"""What runs on every rank: process groups, the Llama stage model with tensor parallelism, the attention
backend, the 1F1B pipeline schedule, gradient sync across unlike pipelines, the optimizer and the engine.

Entry points: `groups.build_groups(plan, rank)` -> `PlanGroups`, then `engine.RankEngine(plan, rank, groups, ...)`.
"""

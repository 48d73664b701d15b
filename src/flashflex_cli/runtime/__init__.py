"""What runs on every rank, in parts, lowest first (docs/architecture.md, "The runtime's parts"):
`device/` (memory counters, out-of-memory reports, timestamps, the emulated slowdown), `model/` (the Llama stage
with tensor parallelism, attention, the loss, initial weights, precision, torch.compile), `parallel/` (process
groups, the 1F1B pipeline, gradient sync across unlike pipelines), `checkpoint/` (DCP, Hugging Face export) and
`training/` (the worker, the engine, optimizer, loss scaling, data, metrics).

Entry points: `training.worker` (`python -m flashflex_cli.runtime.training.worker --config RUN/config.json`), or
in code `parallel.groups.build_groups(plan, rank)` -> `PlanGroups`, then `training.engine.RankEngine(plan, rank,
groups, ...)`.
"""

"""Rank 0's metrics sinks: where each step's metrics row goes (`flashflex launch --metrics`, RunConfig.metrics;
the names and which package each needs: semantics/metrics_sinks.py).

Every sink is a `MetricsSink` (base.py): `write(row)` once per optimizer step, `close()` at the end. One module per
sink: jsonl.py (RUN/metrics.jsonl, always), console.py (the stderr line), tensorboard.py (RUN/tensorboard/),
wandb.py (an offline Weights & Biases run in RUN/wandb/); `open_sinks` (build.py) makes the chosen ones.
"""

from .base import MetricsSink, scalars
from .build import open_sinks

__all__ = ["MetricsSink", "open_sinks", "scalars"]

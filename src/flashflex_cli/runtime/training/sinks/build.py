"""Making the sinks a run chose (RunConfig.metrics) for its run folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ....semantics.metrics_sinks import TENSORBOARD_DIR, WANDB_DIR
from ....semantics.run_folder import METRICS
from .base import MetricsSink


def open_sinks(names: tuple[str, ...], run_dir: str | os.PathLike[str], total_steps: int,
               device_type: str = "cpu", settings: dict[str, Any] | None = None) -> list[MetricsSink]:
    """The sinks `names` ("jsonl", "console", "tensorboard", "wandb"; normalized: RunConfig.metrics) of a run
    of `total_steps` steps writing into `run_dir` on `device_type`; `settings`: the run configuration, for W&B.
    InputError, one line, for a sink whose package is missing (the sinks opened before it are closed)."""
    folder = Path(run_dir)
    opened: list[MetricsSink] = []
    try:
        for name in names:
            opened.append(_open(name, folder, total_steps, device_type, settings))
    except BaseException:
        for sink in opened:
            sink.close()
        raise
    return opened


def _open(name: str, folder: Path, total_steps: int, device_type: str,
          settings: dict[str, Any] | None) -> MetricsSink:
    """One sink by name (imports only what that sink needs)."""
    if name == "jsonl":
        from .jsonl import JsonlSink

        return JsonlSink(folder / METRICS)
    if name == "console":
        from .console import ConsoleSink

        return ConsoleSink(total_steps, device_type)
    if name == "tensorboard":
        from .tensorboard import TensorBoardSink

        return TensorBoardSink(folder / TENSORBOARD_DIR)
    if name == "wandb":
        from .wandb import WandbSink

        return WandbSink(folder / WANDB_DIR, settings)
    raise ValueError(f"unknown metrics sink {name!r}")

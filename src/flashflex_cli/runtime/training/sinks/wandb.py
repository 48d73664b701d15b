"""The Weights & Biases sink, offline: the row's scalar series (base.SCALAR_TAGS) at step = the row's step, in an
offline run under `RUN/wandb/` (nothing leaves the machine; `wandb sync RUN/wandb/wandb/offline-run-*` uploads it
if you wish). The run's settings (RUN/config.json) are its config. Each launch into the run folder is a W&B run
of its own."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ....errors import InputError
from .base import scalars

PROJECT = "flashflex"


class WandbSink:
    """Logs scalars to an offline wandb run kept in `folder`, configured with `settings`."""

    def __init__(self, folder: str | os.PathLike[str], settings: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise InputError("metrics sink wandb needs the wandb package: pip install 'flashflex[wandb]'") from None
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=PROJECT, dir=os.fspath(folder), mode="offline", config=settings or {})

    def write(self, row: dict[str, Any]) -> None:
        """Log the row's scalars at its step."""
        self._run.log(scalars(row), step=int(row["step"]))

    def close(self) -> None:
        """Finish the run (writes its files)."""
        self._run.finish()

"""The TensorBoard sink: the row's scalar series (base.SCALAR_TAGS: "train/loss", "train/tokens_per_s", ...) at
step = the row's step, in event files under `RUN/tensorboard/` (`tensorboard --logdir RUN/tensorboard`). Each
launch into the run folder adds its own event file; steps a resumed launch redoes appear again."""

from __future__ import annotations

import os
from typing import Any

from ....errors import InputError
from .base import scalars


class TensorBoardSink:
    """Writes scalars with torch.utils.tensorboard.SummaryWriter into `log_dir`, flushed after every step."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise InputError("metrics sink tensorboard needs the tensorboard package: "
                             "pip install 'flashflex[tensorboard]'") from None
        self._writer = SummaryWriter(log_dir=os.fspath(log_dir))

    def write(self, row: dict[str, Any]) -> None:
        """Add the row's scalars at its step."""
        step = int(row["step"])
        for tag, value in scalars(row).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()

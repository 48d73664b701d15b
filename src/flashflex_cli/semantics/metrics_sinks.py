"""Where a run's metrics rows go (`flashflex launch --metrics`), torch-free: the launcher checks the choice, the run
configuration records it (RunConfig.metrics), rank 0 writes to every sink chosen (runtime/training/sinks/).

Sinks:
- jsonl: `RUN/metrics.jsonl`, one JSON object per step. Always written, listed or not: `show --run`, `calibrate`,
  the timeline, the launch's summary and the continue-or-refuse decision of the next launch all read it.
- console: one plain line per step on stderr (so a SLURM log has it too).
- tensorboard: scalars under `train/...` tags in `RUN/tensorboard/` (needs the `tensorboard` package).
- wandb: a Weights & Biases run in offline mode under `RUN/wandb/` (needs the `wandb` package; `wandb sync` uploads
  it later, if you wish).
"""

from __future__ import annotations

import importlib.util
from typing import Literal, get_args

from ..errors import InputError

SinkName = Literal["jsonl", "console", "tensorboard", "wandb"]
SINKS: tuple[str, ...] = get_args(SinkName)
DEFAULT_SINKS: tuple[str, ...] = ("jsonl", "console")
ALWAYS_ON = "jsonl"
# The package each optional sink imports, and the extra of flashflex that installs it.
PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
TENSORBOARD_DIR = "tensorboard"  # in the run folder
WANDB_DIR = "wandb"  # in the run folder (wandb adds its own `wandb/` below it)


def normalized(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The sinks `names` in the canonical order of SINKS, jsonl added (always on); ValueError for a sink named
    twice (the names are known: the caller checked them)."""
    repeated = sorted({name for name in names if list(names).count(name) > 1})
    if repeated:
        raise ValueError(f"names {repeated[0]} twice")
    return tuple(name for name in SINKS if name in names or name == ALWAYS_ON)


def parse_sinks(text: str, what: str = "--metrics") -> tuple[str, ...]:
    """The sinks of a comma-separated list ("jsonl,tensorboard"), normalized; InputError naming an unknown or
    repeated name, or an empty one."""
    names = [part.strip() for part in text.split(",")]
    for name in names:
        if name not in SINKS:
            shown = repr(name) if name else "an empty name"
            raise InputError(f"{what} {shown} is no metrics sink (known: {', '.join(SINKS)})")
    try:
        return normalized(names)
    except ValueError as exc:
        raise InputError(f"{what} {exc}") from None


def missing_package(sink: str) -> str | None:
    """The package sink `sink` needs that this Python cannot import (None: it needs none, or it is there)."""
    package = PACKAGES.get(sink)
    if package is None:
        return None
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else package


def check_packages(sinks: tuple[str, ...], what: str = "--metrics") -> None:
    """InputError, in one line, for the first sink of `sinks` whose package is not installed here."""
    for sink in sinks:
        package = missing_package(sink)
        if package is not None:
            raise InputError(f"{what} {sink} needs the {package} package, which is not installed: "
                             f"pip install 'flashflex[{sink}]' (or pip install {package})")

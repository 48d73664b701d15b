"""From `flashflex launch` options to workers: the run configuration the options make, and how a launcher starts
a worker (the module, its two arguments, the environment it adds).

A worker's settings are all in the run configuration (run_config.py, RUN/config.json), written by the launcher
before any worker starts; its command line names only that file and the plan node it runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from ..errors import InputError
from ..run_config import DEFAULT_STEPS, FieldError, LossScaling, RunConfig, build_checked, default_optimizer
from ..semantics.flight_recorder import FIXED as FLIGHT_RECORDER_FIXED
from ..semantics.run_folder import default_checkpoint_dir, recorded_checkpoint_dir
from ..semantics.runtime_paths import RuntimeOptions

WORKER_MODULE = "flashflex_cli.runtime.training.worker"
# The workers' CUDA caching allocator grows its segments instead of caching fixed blocks (less fragmentation over
# steps whose activations differ in size); a value the user set is kept.
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_DEFAULT = "expandable_segments:True"
# The same default in a rendered shell command: the user's value where it is set on the host that runs it.
ALLOC_CONF_SHELL = f'{ALLOC_CONF_ENV}="${{{ALLOC_CONF_ENV}:-{ALLOC_CONF_DEFAULT}}}"'
# NCCL's flight recorder (semantics/flight_recorder.py) in a rendered shell command, the user's values kept; the
# worker adds the dump file's prefix in the run folder itself.
FLIGHT_RECORDER_SHELL = " ".join(f'{names[0]}="${{{names[0]}:-{value}}}"' for names, value in FLIGHT_RECORDER_FIXED)


def worker_argv(config: str | os.PathLike[str], node: str | None = None) -> list[str]:
    """Arguments after `-m flashflex_cli.runtime.training.worker` (or `-m flashflex_cli.launch.elastic_worker`): the run
    configuration file, and the plan node this host runs (None: every node of the plan runs on this host)."""
    return ["--config", str(config), *(["--plan-node", node] if node is not None else [])]


DEFAULT_LR = 1e-3  # `flashflex launch --lr`
# `flashflex launch --checkpoint-every`: as torchtitan's and Hugging Face Trainer's default interval; a run also
# saves at its end and on a stop signal, so a short run has its checkpoint whatever the interval.
DEFAULT_CHECKPOINT_EVERY = 500


def checkpoint_folder(out: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str] | None,
                      checkpoint_every: int | None, no_checkpoint: bool, resume: bool, overwrite: bool) -> str | None:
    """The checkpoint folder of a launch: --checkpoint-dir, else the one the run folder's config.json names (an
    earlier launch's --checkpoint-dir: the run's checkpoints stay where they are), else RUN/checkpoints; None with
    --no-checkpoint. InputError for options that contradict each other."""
    if resume and overwrite:
        raise InputError("--resume and --overwrite contradict each other: continue the run, or start it again")
    if not no_checkpoint:
        if checkpoint_dir is not None:
            return os.fspath(checkpoint_dir)
        return recorded_checkpoint_dir(out) or default_checkpoint_dir(out)
    given = [name for name, value in (("--checkpoint-dir", checkpoint_dir), ("--checkpoint-every", checkpoint_every),
                                      ("--resume", resume or None)) if value is not None]
    if given:
        raise InputError(f"--no-checkpoint contradicts {', '.join(given)}")
    return None
# The `flashflex launch` option that sets each field (a field error of a launch names the option).
LAUNCH_OPTIONS: dict[str, str] = {
    "plan": "PLAN", "cluster": "--cluster", "out": "--out", "data": "--data", "steps": "--steps", "seed": "--seed",
    "timeout_s": "--timeout", "setup_timeout_s": "--setup-timeout", "checkpoint_dir": "--checkpoint-dir", "checkpoint_every": "--checkpoint-every",
    "init_from": "--init-from", "share_gpu": "--share-gpu", "gpus": "--gpus", "optimizer.lr": "--lr", "optimizer.total_steps": "--schedule-steps",
    "runtime.optimizer": "--optimizer", "runtime.compile": "--compile", "metrics": "--metrics",
    "runtime.loss_kernel": "--loss-kernel", "runtime.compile_scope": "--compile-scope",
}


@contextmanager
def _named_by_options(schedule_given: bool) -> Iterator[None]:
    """Report a FieldError by the launch option that set the field."""
    try:
        yield
    except FieldError as exc:
        names = dict(LAUNCH_OPTIONS, **({} if schedule_given else {"optimizer.total_steps": "--steps"}))
        raise InputError(f"{names.get(exc.field, exc.field)} {exc.problem}") from None


def launch_config(*, plan: str, cluster: str, out: str, lr: float = DEFAULT_LR, schedule_steps: int | None = None,
                  runtime: dict[str, Any] | None = None, **run: Any) -> RunConfig:
    """The run configuration of `flashflex launch`: the run's fields `run` (RunConfig's, default where absent),
    the runtime switches `runtime` (RuntimeOptions' fields, default where absent), the optimizer by the launch's
    policy (run_config.default_optimizer) for peak `lr` over `schedule_steps` (default: the run's steps), default
    loss scaling. InputError naming the launch option of a bad value."""
    with _named_by_options(schedule_steps is not None):
        switches = build_checked(RuntimeOptions, {**asdict(RuntimeOptions()), **(runtime or {})}, "runtime")
        total_steps = run.get("steps", DEFAULT_STEPS) if schedule_steps is None else schedule_steps
        try:
            optimizer = default_optimizer(lr, total_steps)
        except FieldError as exc:
            raise exc.within("optimizer") from None
        return build_checked(RunConfig, {"plan": plan, "cluster": cluster, "out": out, "runtime": switches,
                                         "optimizer": optimizer, "loss_scaling": LossScaling(), **run})

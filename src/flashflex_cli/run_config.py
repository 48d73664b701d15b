"""The settings of one training run, saved as `RUN/config.json`: the one file every worker reads.

`flashflex launch` builds a RunConfig from its options (launch/options.launch_config; the learning-rate policy
`default_optimizer` fills in what the options leave out) and saves it in the run folder before any worker starts:
launch/local.py before each job (so launch/elastic.py rewrites it, with the new plan and --resume, before each
relaunch), `--launcher torchrun / slurm` when it renders the script. A worker is started with
`--config RUN/config.json --plan-node NODE` only (runtime/training/worker.py) and runs with exactly these settings:
- the run: plan, cluster, run folder, data, steps, seed, collective timeouts (the steps', and the long one of
  set-up, the first step and checkpoint saves), checkpoints, initial weights;
- `runtime`: the runtime switches (semantics/runtime_paths.RuntimeOptions, before their per-device resolution);
- `optimizer`: AdamW and its learning-rate schedule (OptimConfig: warm-up, cosine decay to min_lr at total_steps);
- `loss_scaling`: the dynamic loss scaling of fp16 plans (LossScaling; bf16 and fp32 plans use none).
The compute dtype is no setting: the runtime derives it from the plan's dtype (semantics/runtime_paths.compute_dtype).

The file: {"schema": "flashflex.run/1", the run's fields, "runtime": {...}, "optimizer": {...},
"loss_scaling": {...}}, keys sorted, written atomically. Paths are kept as the user gave them: relative ones are
relative to the working directory of the launch, which must be the workers' too, and a rendered script's hosts
must all read the plan, the cluster and RUN/config.json at these paths. Loading refuses a missing or unknown key,
a wrong JSON type and an impossible value, each in one line naming the field (InputError, exit code 2).

The settings are frozen dataclasses (RuntimeOptions is shared with the cost model's reader of runtime.json), so
the loader checks the JSON types by their annotations (`build_checked`) rather than restating each class as a schema.
"""

from __future__ import annotations

import json
import math
import os
import types
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from . import validate_numbers
from .errors import InputError
from .fileio import atomic_write_text, read_json
from .physical_limits import shown
from .semantics.runtime_paths import RuntimeOptions

SCHEMA = "flashflex.run/1"
CONFIG_FILE = "config.json"  # in the run folder
DEFAULT_STEPS = 10  # `flashflex launch --steps`
DEFAULT_SETUP_TIMEOUT_S = 600.0  # the long collective timeout's floor (runtime/parallel/timeouts.py)
FP32_MAX = 3.4028234663852886e38  # the largest finite fp32 number: GradScaler keeps its scale in fp32
MAX_GROWTH_INTERVAL = 2**31 - 1  # GradScaler counts clean steps in an int32


class FieldError(InputError):
    """An impossible value of one setting: `field` (its path in config.json, "optimizer.lr") and `problem`
    ("must be positive, got 0")."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem

    def within(self, section: str) -> FieldError:
        """The same error, its field named inside `section`."""
        return FieldError(f"{section}.{self.field}", self.problem)


def _checked(field: str, check: Any, value: Any, *args: Any) -> None:
    """Apply a validate_numbers check to `value`, its InputError becoming a FieldError of `field`."""
    try:
        check(value, field, *args)
    except InputError as exc:
        raise FieldError(field, str(exc).removeprefix(f"{field} ")) from None


def _path(value: str | None, field: str) -> None:
    if value is not None and not value:
        raise FieldError(field, "must be a path, got an empty string")


# ---- the optimizer and its learning-rate schedule ----------------------------------------------------------------

@dataclass(frozen=True)
class OptimConfig:
    """AdamW with a learning-rate schedule (runtime/training/optimizer.py). lr and min_lr are the peak and final learning
    rates; warmup_steps and total_steps count optimizer steps (warm-up to lr, cosine decay to min_lr at
    total_steps); weight_decay applies to matrices only; grad_clip is the global gradient-norm limit (0: none)."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    total_steps: int = 1000
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _checked("lr", validate_numbers.learning_rate, self.lr)
        _checked("min_lr", validate_numbers.non_negative, self.min_lr)
        if self.min_lr > self.lr:
            raise FieldError("min_lr", f"must be at most lr ({self.lr:g}), got {self.min_lr:g}")
        _checked("total_steps", validate_numbers.steps, self.total_steps)
        _checked("warmup_steps", validate_numbers.int_in_range, self.warmup_steps, 0, validate_numbers.MAX_STEPS)
        if self.warmup_steps > self.total_steps:
            raise FieldError("warmup_steps", f"must be at most total_steps ({self.total_steps}), got "
                                             f"{self.warmup_steps}")
        _checked("weight_decay", validate_numbers.non_negative, self.weight_decay)
        if len(self.betas) != 2 or not all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in self.betas):
            raise FieldError("betas", f"must be two numbers in [0, 1), got {shown(self.betas)}")
        _checked("eps", validate_numbers.positive, self.eps)
        _checked("grad_clip", validate_numbers.non_negative, self.grad_clip)


def default_optimizer(lr: float, total_steps: int) -> OptimConfig:
    """The launcher's learning-rate policy for a peak `lr` over a schedule of `total_steps` optimizer steps:
    decay to lr / 10, warm-up over a tenth of the schedule (at least 1 step, at most 10), AdamW's other settings
    at OptimConfig's defaults."""
    return OptimConfig(lr=lr, min_lr=lr / 10, warmup_steps=min(10, max(1, total_steps // 10)),
                       total_steps=total_steps)


# ---- precision ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling of fp16 plans (runtime/training/loss_scale.py; torch.amp.GradScaler's defaults): the initial
    scale, the factor it grows by after `growth_interval` clean steps in a row, the factor it shrinks by on a
    skipped step."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        _checked("init_scale", validate_numbers.positive, self.init_scale, FP32_MAX)
        _checked("growth_factor", validate_numbers.finite, self.growth_factor)
        if not self.growth_factor > 1.0:
            raise FieldError("growth_factor", f"must be more than 1, got {shown(self.growth_factor)}")
        _checked("backoff_factor", validate_numbers.finite, self.backoff_factor)
        if not 0.0 < self.backoff_factor < 1.0:
            raise FieldError("backoff_factor", f"must be in (0, 1), got {shown(self.backoff_factor)}")
        _checked("growth_interval", validate_numbers.int_in_range, self.growth_interval, 1, MAX_GROWTH_INTERVAL)

    def to_record(self) -> dict[str, float | int]:
        """The runtime.json object of the settings."""
        return asdict(self)


# ---- the run ------------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run's settings (module docstring). Paths as the user gave them; timeout_s: collective timeout of the
    steps in seconds (survivors of a dead rank exit instead of hanging); setup_timeout_s: the long collective
    and rendezvous timeout of set-up, compile warm-up, checkpoint load, the first step and checkpoint saves
    (runtime/parallel/timeouts.py; None: `setup_seconds`' default, at least timeout_s); steps: the optimizer step to stop at,
    counting resumed ones (optimizer.total_steps, the schedule's length, may be longer: a run can stop early and
    resume onto the same trajectory); checkpoint_every: steps between checkpoints (0: only at the end and on a
    stop signal); init_from: a local Hugging Face checkpoint folder of the initial weights (hf/load.py);
    share_gpu: every rank of the GPU plan drives this machine's first GPU (launch/share_gpu.py, a validation
    mode); gpus: the host's GPUs a local launch runs on, comma-separated ("2,3": launch/gpu_subset.py)."""

    plan: str
    cluster: str
    out: str
    data: str = "synthetic"
    steps: int = DEFAULT_STEPS
    seed: int = 0
    timeout_s: float = 60.0
    setup_timeout_s: float | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    init_from: str | None = None
    share_gpu: bool = False
    gpus: str | None = None
    runtime: RuntimeOptions
    optimizer: OptimConfig
    loss_scaling: LossScaling

    def __post_init__(self) -> None:
        for name in ("plan", "cluster", "out", "data", "checkpoint_dir", "init_from"):
            _path(getattr(self, name), name)
        _checked("steps", validate_numbers.steps, self.steps)
        _checked("seed", validate_numbers.seed, self.seed)
        _checked("timeout_s", validate_numbers.timeout_s, self.timeout_s)
        if self.setup_timeout_s is not None:
            _checked("setup_timeout_s", validate_numbers.timeout_s, self.setup_timeout_s)
            if self.setup_timeout_s < self.timeout_s:
                raise FieldError("setup_timeout_s", f"must be at least timeout_s (--timeout: {self.timeout_s:g}), got "
                                                    f"{self.setup_timeout_s:g}")
        _checked("checkpoint_every", validate_numbers.int_in_range, self.checkpoint_every, 0,
                 validate_numbers.MAX_STEPS)
        if self.gpus is not None:
            _checked("gpus", validate_numbers.gpu_list, self.gpus)

    @property
    def gpu_indices(self) -> tuple[int, ...] | None:
        """`gpus` as indices (None: every GPU of the host)."""
        return None if self.gpus is None else validate_numbers.gpu_list(self.gpus)

    @property
    def setup_seconds(self) -> float:
        """The long collective timeout (s): setup_timeout_s, else the larger of timeout_s and 600 s."""
        if self.setup_timeout_s is not None:
            return self.setup_timeout_s
        return max(self.timeout_s, DEFAULT_SETUP_TIMEOUT_S)

    @property
    def path(self) -> Path:
        """Where the config is saved: RUN/config.json."""
        return config_path(self.out)

    def to_json(self) -> str:
        """The file's text: sorted keys, 2-space indent, a newline at the end."""
        data: dict[str, Any] = {"schema": SCHEMA, **asdict(self)}
        return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def config_path(out: str | os.PathLike[str]) -> Path:
    """The run configuration of run folder `out`."""
    return Path(out) / CONFIG_FILE


_SECTIONS: dict[str, type] = {"runtime": RuntimeOptions, "optimizer": OptimConfig, "loss_scaling": LossScaling}


# ---- building from values, checking JSON types ---------------------------------------------------------------

def _type_text(hint: Any) -> str:
    """What a value of type `hint` is called in an error ("a number", "true or false", ...)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return f"one of {', '.join(str(a) for a in args)}"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_text(a) for a in args)
    if origin is tuple:
        return f"a list of {len(args)} {_type_text(args[0]).removeprefix('a ')}s"
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
            type(None): "null"}[hint]


def _typed(value: Any, hint: Any) -> tuple[bool, Any]:
    """(whether `value`, as JSON gives it, is of type `hint`; the value to construct with: a list becomes a
    tuple, an integer for a float field a float)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return value in args and isinstance(value, str), value
    if origin in (Union, types.UnionType):
        for arg in args:
            ok, converted = _typed(value, arg)
            if ok:
                return True, converted
        return False, value
    if origin is tuple:
        if not isinstance(value, list | tuple) or len(value) != len(args):
            return False, value
        items = [_typed(item, arg) for item, arg in zip(value, args, strict=True)]
        return all(ok for ok, _ in items), tuple(converted for _, converted in items)
    if hint is type(None):
        return value is None, value
    if isinstance(value, bool) or hint is bool:
        return isinstance(value, bool) and hint is bool, value
    if hint is float and isinstance(value, int | float):
        try:
            return True, float(value)
        except OverflowError:  # an integer beyond any float: the range check refuses the infinity
            return True, math.inf
    return isinstance(value, hint), value


T = TypeVar("T")


def build_checked(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    """`cls(**values)` after checking that `values` names every field of the dataclass `cls` and nothing else,
    each of its annotated type; a FieldError names the field inside `where` ("optimizer")."""
    prefix = f"{where}." if where else ""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise FieldError(prefix + unknown[0], f"is no setting (known: {', '.join(sorted(names))})")
    missing = [name for name in names if name not in values]
    if missing:
        raise FieldError(prefix + missing[0], "is missing")
    hints = get_type_hints(cls)
    checked: dict[str, Any] = {}
    for name in names:
        ok, checked[name] = _typed(values[name], hints[name])
        if not ok:
            raise FieldError(prefix + name, f"must be {_type_text(hints[name])}, got {shown(values[name])}")
    try:
        return cls(**checked)
    except FieldError as exc:
        raise exc.within(where) if where else exc from None


def from_dict(data: Any) -> RunConfig:
    """A RunConfig from the parsed JSON of a config file (schema checked; FieldError naming the field)."""
    if not isinstance(data, dict):
        raise InputError("expected a JSON object at the top level")
    if data.get("schema") != SCHEMA:
        raise InputError(f"unknown schema {data.get('schema')!r}, expected {SCHEMA!r}")
    values = {key: value for key, value in data.items() if key != "schema"}
    for section, cls in _SECTIONS.items():
        if isinstance(values.get(section), dict):
            values[section] = build_checked(cls, values[section], section)
        elif section in values:
            raise FieldError(section, f"must be an object, got {shown(values[section])}")
    return build_checked(RunConfig, values)


def load_run_config(path: str | os.PathLike[str]) -> RunConfig:
    """Read and check a run configuration file; InputError "PATH: FIELD PROBLEM" in one line."""
    data = read_json(path)
    try:
        return from_dict(data)
    except InputError as exc:
        raise InputError(f"{path}: {exc}") from None


def save_run_config(config: RunConfig) -> Path:
    """Write RUN/config.json atomically (creating the run folder); returns its path."""
    return atomic_write_text(config.path, config.to_json())

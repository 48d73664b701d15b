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
a wrong JSON type and an impossible value, each in one line naming the field (InputError, exit code 2). A key
added to the format after its first version (`ADDED_LATER`) may be absent: files written before it load with its
default.

The settings are frozen pydantic dataclasses: pydantic checks every value's JSON type (no conversion: "1" is no
number, 1.5 no step count, true no integer; an integer for a number becomes a float), refuses unknown keys, and
runs the range checks declared with each field (validate_numbers), on load and whenever a setting is built or
replaced in code (dataclasses.replace works, and checks). They stay dataclasses because RuntimeOptions is shared
with the cost model, and code across the runtime and the launcher copies settings with dataclasses.replace. The
first refused value is a FieldError naming the field, in the project's words (fileio.setting_problem): on load
(`build_checked`) and when built in code (`fileio.refused_in_one_line`).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import PydanticCustomError

from . import validate_numbers
from .errors import InputError
from .fileio import atomic_write_text, read_json, refused_in_one_line, setting_problem
from .physical_limits import shown
from .semantics.metrics_sinks import DEFAULT_SINKS, SinkName, normalized
from .semantics.runtime_paths import RuntimeOptions

SCHEMA = "flashflex.run/1"
CONFIG_FILE = "config.json"  # in the run folder
DEFAULT_STEPS = 10  # `flashflex launch --steps`
DEFAULT_SETUP_TIMEOUT_S = 600.0  # the long collective timeout's floor (runtime/parallel/timeouts.py)
FP32_MAX = 3.4028234663852886e38  # the largest finite fp32 number: GradScaler keeps its scale in fp32
MAX_GROWTH_INTERVAL = 2**31 - 1  # GradScaler counts clean steps in an int32
SETTING_ERROR = "setting"  # the pydantic error type of a refused value (its message shows the value)


class FieldError(InputError):
    """An impossible value of one setting: `field` (its path in config.json, "optimizer.lr") and `problem`
    ("must be positive, got 0")."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem

    def within(self, section: str) -> FieldError:
        """The same error, its field named inside `section`."""
        return FieldError(f"{section}.{self.field}", self.problem)


def _checked(check: Callable[..., Any], *args: Any) -> AfterValidator:
    """A field's range check: validate_numbers' `check(value, what, *args)`, its one-line InputError becoming the
    field's pydantic error (the field's name is added by whoever reports it)."""

    def validate(value: Any) -> Any:
        try:
            check(value, "", *args)
        except InputError as exc:
            raise PydanticCustomError(SETTING_ERROR, str(exc).strip()) from None
        return value

    return AfterValidator(validate)


def _refused(field: str, problem: str) -> PydanticCustomError:
    """The error of a check across fields, naming the `field` it refuses."""
    return PydanticCustomError(SETTING_ERROR, problem, {"field": field})


def _a_path(value: str, what: str) -> str:
    if not value:
        raise InputError(f"{what} must be a path, got an empty string")
    return value


def _more_than_one(value: float, what: str) -> float:
    if not validate_numbers.finite(value, what) > 1.0:
        raise InputError(f"{what} must be more than 1, got {shown(value)}")
    return value


def _in_open_unit(value: float, what: str) -> float:
    if not 0.0 < validate_numbers.finite(value, what) < 1.0:
        raise InputError(f"{what} must be in (0, 1), got {shown(value)}")
    return value


def _betas(value: tuple[float, float], what: str) -> tuple[float, float]:
    if not all(0.0 <= beta < 1.0 for beta in value):
        raise InputError(f"{what} must be two numbers in [0, 1), got {shown(value)}")
    return value


def _as_float(value: Any) -> Any:
    """An integer given for a number as a float (one beyond any float: infinity, which the range check refuses);
    anything else as it is, for the strict type check."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    return value


# The field types: a JSON type (strict: no conversion but an integer for a number) and its range.
Number = Annotated[StrictFloat, BeforeValidator(_as_float)]
PathText = Annotated[StrictStr, _checked(_a_path)]
StepCount = Annotated[StrictInt, _checked(validate_numbers.steps)]
StepInterval = Annotated[StrictInt, _checked(validate_numbers.int_in_range, 0, validate_numbers.MAX_STEPS)]
Seconds = Annotated[Number, _checked(validate_numbers.timeout_s)]
Positive = Annotated[Number, _checked(validate_numbers.positive)]
NonNegative = Annotated[Number, _checked(validate_numbers.non_negative)]

# pydantic's settings of every part: unknown keys refused, frozen; NaN and infinities reach the range checks,
# which refuse them by name.
SETTINGS_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=True)


# ---- the optimizer and its learning-rate schedule ----------------------------------------------------------------

@refused_in_one_line(FieldError)
@dataclass(frozen=True, config=SETTINGS_CONFIG)
class OptimConfig:
    """AdamW with a learning-rate schedule (runtime/training/optimizer.py). lr and min_lr are the peak and final learning
    rates; warmup_steps and total_steps count optimizer steps (warm-up to lr, cosine decay to min_lr at
    total_steps); weight_decay applies to matrices only; grad_clip is the global gradient-norm limit (0: none)."""

    lr: Annotated[Number, _checked(validate_numbers.learning_rate)] = 3e-4
    min_lr: NonNegative = 3e-5
    warmup_steps: StepInterval = 10
    total_steps: StepCount = 1000
    weight_decay: NonNegative = 0.1
    betas: Annotated[tuple[Number, Number], _checked(_betas)] = (0.9, 0.95)
    eps: Positive = 1e-8
    grad_clip: NonNegative = 1.0

    @model_validator(mode="after")
    def _schedule(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise _refused("min_lr", f"must be at most lr ({self.lr:g}), got {self.min_lr:g}")
        if self.warmup_steps > self.total_steps:
            raise _refused("warmup_steps", f"must be at most total_steps ({self.total_steps}), got "
                                           f"{self.warmup_steps}")
        return self


def default_optimizer(lr: float, total_steps: int) -> OptimConfig:
    """The launcher's learning-rate policy for a peak `lr` over a schedule of `total_steps` optimizer steps:
    decay to lr / 10, warm-up over a tenth of the schedule (at least 1 step, at most 10), AdamW's other settings
    at OptimConfig's defaults. FieldError naming a bad value."""
    return build_checked(OptimConfig, {"lr": lr, "min_lr": lr / 10, "total_steps": total_steps,
                                       "warmup_steps": min(10, max(1, total_steps // 10))})


# ---- precision ----------------------------------------------------------------------------------------------

@refused_in_one_line(FieldError)
@dataclass(frozen=True, config=SETTINGS_CONFIG)
class LossScaling:
    """Dynamic loss scaling of fp16 plans (runtime/training/loss_scale.py; torch.amp.GradScaler's defaults): the initial
    scale, the factor it grows by after `growth_interval` clean steps in a row, the factor it shrinks by on a
    skipped step."""

    init_scale: Annotated[Number, _checked(validate_numbers.positive, FP32_MAX)] = 2.0**16
    growth_factor: Annotated[Number, _checked(_more_than_one)] = 2.0
    backoff_factor: Annotated[Number, _checked(_in_open_unit)] = 0.5
    growth_interval: Annotated[StrictInt, _checked(validate_numbers.int_in_range, 1, MAX_GROWTH_INTERVAL)] = 2000

    def to_record(self) -> dict[str, float | int]:
        """The runtime.json object of the settings."""
        return asdict(self)


# ---- the run ------------------------------------------------------------------------------------------------

@refused_in_one_line(FieldError)
@dataclass(frozen=True, kw_only=True, config=SETTINGS_CONFIG)
class RunConfig:
    """One run's settings (module docstring). Paths as the user gave them; timeout_s: collective timeout of the
    steps in seconds (survivors of a dead rank exit instead of hanging); setup_timeout_s: the long collective
    and rendezvous timeout of set-up, compile warm-up, checkpoint load, the first step and checkpoint saves
    (runtime/parallel/timeouts.py; None: `setup_seconds`' default, at least timeout_s); steps: the optimizer step to stop at,
    counting resumed ones (optimizer.total_steps, the schedule's length, may be longer: a run can stop early and
    resume onto the same trajectory); checkpoint_every: steps between checkpoints (0: only at the end and on a
    stop signal); init_from: a local Hugging Face checkpoint folder of the initial weights (hf/load.py);
    share_gpu: every rank of the GPU plan drives this machine's first GPU (launch/share_gpu.py, a validation
    mode); gpus: the host's GPUs a local launch runs on, comma-separated ("2,3": launch/gpu_subset.py);
    metrics: where rank 0 writes the metrics rows (semantics/metrics_sinks.py; jsonl always, in canonical order)."""

    plan: PathText
    cluster: PathText
    out: PathText
    data: PathText = "synthetic"
    steps: StepCount = DEFAULT_STEPS
    seed: Annotated[StrictInt, _checked(validate_numbers.seed)] = 0
    timeout_s: Seconds = 60.0
    setup_timeout_s: Seconds | None = None
    checkpoint_dir: PathText | None = None
    checkpoint_every: StepInterval = 0
    resume: StrictBool = False
    init_from: PathText | None = None
    share_gpu: StrictBool = False
    gpus: Annotated[StrictStr, _checked(validate_numbers.gpu_list)] | None = None
    metrics: tuple[SinkName, ...] = DEFAULT_SINKS
    runtime: RuntimeOptions
    optimizer: OptimConfig
    loss_scaling: LossScaling

    @field_validator("metrics")
    @classmethod
    def _sinks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        try:
            return normalized(value)
        except ValueError as exc:
            raise PydanticCustomError(SETTING_ERROR, str(exc)) from None

    @model_validator(mode="after")
    def _timeouts(self) -> RunConfig:
        if self.setup_timeout_s is not None and self.setup_timeout_s < self.timeout_s:
            raise _refused("setup_timeout_s", f"must be at least timeout_s (--timeout: {self.timeout_s:g}), got "
                                              f"{self.setup_timeout_s:g}")
        return self

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


# Keys of RunConfig added after the format's first version: a file written before one was added loads with its
# default (every other key must be in the file).
ADDED_LATER = ("setup_timeout_s", "share_gpu", "gpus", "metrics")


def config_path(out: str | os.PathLike[str]) -> Path:
    """The run configuration of run folder `out`."""
    return Path(out) / CONFIG_FILE


# ---- building from values --------------------------------------------------------------------------------------

T = TypeVar("T")


@functools.cache
def _adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


_SECTIONS: dict[str, type] = {"runtime": RuntimeOptions, "optimizer": OptimConfig, "loss_scaling": LossScaling}


def build_checked(cls: type[T], values: dict[str, Any], where: str = "") -> T:
    """`cls` (a settings dataclass) from `values`, as JSON gives them (unknown keys refused; absent ones take their
    defaults); a FieldError names the first refused field inside `where` ("optimizer")."""
    try:
        return _adapter(cls).validate_python(values)
    except ValidationError as exc:
        error = FieldError(*setting_problem(cls, values, exc))
        raise error.within(where) if where else error from None


def _refuse_absent(values: dict[str, Any]) -> None:
    """FieldError for the first key a config file must hold and `values` lacks (ADDED_LATER ones may be absent)."""
    for field in fields(RunConfig):
        if field.name not in values and field.name not in ADDED_LATER:
            raise FieldError(field.name, "is missing")
    for section, part in _SECTIONS.items():
        for field in fields(part):
            if field.name not in values[section]:
                raise FieldError(f"{section}.{field.name}", "is missing")


def from_dict(data: Any) -> RunConfig:
    """A RunConfig from the parsed JSON of a config file (schema checked; FieldError naming the field)."""
    if not isinstance(data, dict):
        raise InputError("expected a JSON object at the top level")
    if data.get("schema") != SCHEMA:
        raise InputError(f"unknown schema {data.get('schema')!r}, expected {SCHEMA!r}")
    values = {key: value for key, value in data.items() if key != "schema"}
    config = build_checked(RunConfig, values)
    _refuse_absent(values)
    return config


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

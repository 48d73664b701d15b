"""Plan schema ("flashflex.plan/1"): an asymmetric DP x PP x TP layout, validated on load.

A pipeline is a data-parallel replica: an ordered list of stages covering every transformer layer once.
A stage is a tensor-parallel group: `tp == len(devices)` devices running layers [start, end).
Ranks are numbered pipelines in order, stages in order, devices in order (`Plan.ranks()`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from ..fileio import dumps_json, load_model
from ..model.spec import ModelSpec
from ..physical_limits import LAYER_INDEX, SEED, SEQ_LEN, SEQUENCES, TP_DEGREE, limited, shown
from ..semantics.outer_sync import OUTER_LR, OUTER_MOMENTUM

PLAN_SCHEMA = "flashflex.plan/1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


# Counts within the size limits of physical_limits.py (a string, a boolean or a huge integer is refused)
Sequences = limited(SEQUENCES)
SeqLen = limited(SEQ_LEN)
TpDegree = limited(TP_DEGREE)
LayerIndex = limited(LAYER_INDEX)
Seed = limited(SEED)


class TrainConfig(_Strict):
    """What one optimizer step processes. global_batch counts sequences; each pipeline of the plan carries its
    own micro-batch size (`PipelinePlan.micro_batch_size`).

    dtype: bf16/fp16 (mixed precision), fp32, or tf32 (fp32 tensors, TF32 tensor-core matmuls).
    attention: the attention kernel: flash (flash-attn), sdpa (torch's fused scaled_dot_product_attention)
    or eager (softmax(QK^T)V, keeping the s x s probabilities for the backward). Plans written before the
    field existed load as sdpa, what the runtime used then.
    """

    global_batch: Sequences
    seq_len: SeqLen
    dtype: Literal["bf16", "fp16", "fp32", "tf32"] = "bf16"
    recompute: bool = False
    attention: Literal["flash", "sdpa", "eager"] = "sdpa"

    @model_validator(mode="before")
    @classmethod
    def _drop_old_micro_batch(cls, data: Any) -> Any:
        """Plans written before the pipelines were the micro-batch size's only home carry a placeholder
        `micro_batch_size` here (what the planner was given); it is checked as a count and dropped."""
        if isinstance(data, dict) and "micro_batch_size" in data:
            data = dict(data)
            problem = SEQUENCES.problem(data.pop("micro_batch_size"))
            if problem is not None:
                raise ValueError(f"micro_batch_size {problem}")
        return data

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one global batch."""
        return self.global_batch * self.seq_len


class StagePlan(_Strict):
    """One stage: a TP group of `tp` devices running transformer layers [layers[0], layers[1])."""

    devices: list[str] = Field(min_length=1)
    tp: TpDegree
    layers: tuple[LayerIndex, LayerIndex]

    @model_validator(mode="after")
    def _shape(self) -> StagePlan:
        if self.tp != len(self.devices):
            raise ValueError(f"tp {self.tp} does not match {len(self.devices)} devices")
        if self.layers[1] <= self.layers[0]:
            raise ValueError(f"empty layer range {list(self.layers)}")
        return self

    @property
    def num_layers(self) -> int:
        """Transformer layers held by this stage."""
        return self.layers[1] - self.layers[0]


class PipelinePlan(_Strict):
    """One data-parallel replica: its stages and its share of the global batch (in micro-batches)."""

    micro_batch_size: Sequences
    num_micro_batches: Sequences
    stages: list[StagePlan] = Field(min_length=1)

    @property
    def sequences(self) -> int:
        """Sequences of the global batch this pipeline processes per step."""
        return self.micro_batch_size * self.num_micro_batches


class OuterOptimizer(_Strict):
    """The outer optimizer of low-communication training: SGD with Nesterov momentum on the global parameters
    (DiLoCo, arXiv 2311.08105: lr 0.7, momentum 0.9). lr 1 and momentum 0 make the outer step plain averaging (Nesterov needs a momentum: off at 0)."""

    lr: float = Field(OUTER_LR, gt=0.0, le=10.0)
    momentum: float = Field(OUTER_MOMENTUM, ge=0.0, lt=1.0)
    nesterov: bool = True


class ReplicaGroup(_Strict):
    """One replica group: consecutive pipelines of the plan (indices into `Plan.pipelines`), training
    synchronously among themselves, and the inner steps they run per round."""

    pipelines: list[LayerIndex] = Field(min_length=1)
    inner_steps: Sequences


class OuterSync(_Strict):
    """Replica groups joined by an outer step every round (semantics/outer_sync.py). `compression`: the dtype
    pseudo-gradients cross the links in (fp32, bf16, int8); `fragments`: the model's layers split into this many
    fragments synced in turn (Streaming DiLoCo, arXiv 2501.18512; 1 = the whole model each round).
    `reason`: why the planner chose it (traffic saved, the quality evidence); absent in hand-written plans."""

    groups: list[ReplicaGroup] = Field(min_length=1)
    optimizer: OuterOptimizer = OuterOptimizer()
    compression: Literal["fp32", "bf16", "int8"] = "bf16"
    fragments: LayerIndex = 1
    reason: str | None = None

    @model_validator(mode="after")
    def _fragments(self) -> OuterSync:
        if self.fragments < 1:
            raise ValueError(f"fragments must be at least 1, got {self.fragments}")
        return self


class UnusedDevice(_Strict):
    """A device the plan leaves idle, and why."""

    device: str
    reason: str


class PlanInputs(_Strict):
    """What the plan was made from: the cluster (by hash), the model, the training configuration, and the
    sha256 of every measured layer profile its prediction used (absent: none, or an earlier version).
    cluster_path: the cluster file as `flashflex plan` was given it (absent in older plans); `flashflex launch`
    without --cluster opens it and still checks its sha256.
    dtype_reason: why `flashflex plan --dtype auto` chose `train.dtype` (absent: the dtype was given)."""

    cluster_sha256: str
    cluster_name: str = ""
    model: ModelSpec
    train: TrainConfig
    strategy: str = "manual"
    seed: Seed = 0
    layer_profiles: list[str] | None = None
    cluster_path: str | None = None
    dtype_reason: str | None = None


_PREDICTED_REQUIRED = ("tokens_per_s", "mfu", "iteration_time_s")
_PREDICTED_NUMBERS = ("model_flops_per_token", "peak_flops_used", "dp_exposed_s", "optimizer_s",
                      "peak_flops_cluster")
# optional `predicted.dollars` (planner/fleet/economics.py): cost per hour and per million tokens; null = unknown
_DOLLAR_NUMBERS = ("per_hour_used", "per_hour_cluster", "per_million_tokens_used", "per_million_tokens_cluster")
_STAGE_NUMBERS = ("time_s", "memory_bytes", "memory_capacity_bytes")
_LARGEST_NUMBER = 1e300  # above it a product or a sum of two predicted figures overflows a float


def _expect(value: Any, kind: str, where: str) -> None:
    """Raise ValueError unless `value` is of `kind`: number (int/float, not bool), integer, bool, str, list."""
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    ok = {"number": numeric, "integer": numeric and isinstance(value, int), "bool": isinstance(value, bool),
          "str": isinstance(value, str), "list": isinstance(value, list), "object": isinstance(value, dict)}[kind]
    if not ok:
        raise ValueError(f"{where} must be a{'n' if kind[0] in 'aeiou' else ''} {kind}, got {value!r}"[:200])


def _check_predicted_stage(stage: Any, where: str) -> None:
    _expect(stage, "object", where)
    for key in ("pipeline", "stage"):
        _expect(stage.get(key), "integer", f"{where}.{key}")
    for key in _STAGE_NUMBERS:
        if key in stage:
            _expect(stage[key], "number", f"{where}.{key}")
    _check_not_negative(stage, _STAGE_NUMBERS, where)
    if "source" in stage:
        _expect(stage["source"], "str", f"{where}.source")
    if "dtype_not_native_on" in stage:  # device types lacking the training dtype (absent: none, or older)
        _expect(stage["dtype_not_native_on"], "list", f"{where}.dtype_not_native_on")
        for j, name in enumerate(stage["dtype_not_native_on"]):
            _expect(name, "str", f"{where}.dtype_not_native_on.{j}")


def _check_finite(value: Any, where: str) -> None:
    """Every number in `value` (nested objects and lists too) is finite and at most _LARGEST_NUMBER in size:
    JSON's NaN and Infinity, and an integer too large for a float, are no prediction the cost model makes."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, f"{where}.{i}")
    elif isinstance(value, int | float) and not isinstance(value, bool) and not abs(value) <= _LARGEST_NUMBER:
        raise ValueError(f"{where} must be a finite number, got {shown(value)}")


def _check_not_negative(section: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    """The times, rates and sizes show and diff read are not negative (a breakdown term may be by rounding:
    a bubble fraction of -4e-16)."""
    for key in keys:
        value = section.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{where}.{key} must not be negative, got {shown(value)}")


def check_predicted(predicted: dict[str, Any] | None) -> dict[str, Any] | None:
    """The fields of a plan's `predicted` section that show/diff read have the right types and are not
    negative; every number in it is finite."""
    if not predicted:
        return predicted
    _check_finite(predicted, "predicted")
    for key in _PREDICTED_REQUIRED:
        _expect(predicted.get(key), "number", f"predicted.{key}")
    for key in _PREDICTED_NUMBERS:
        if key in predicted:
            _expect(predicted[key], "number", f"predicted.{key}")
    if "devices_cluster" in predicted:
        _expect(predicted["devices_cluster"], "integer", "predicted.devices_cluster")
    if "dollars" in predicted:
        _expect(predicted["dollars"], "object", "predicted.dollars")
        for key in _DOLLAR_NUMBERS:
            if predicted["dollars"].get(key) is not None:
                _expect(predicted["dollars"][key], "number", f"predicted.dollars.{key}")
        _expect(predicted["dollars"].get("currency", ""), "str", "predicted.dollars.currency")
    if "fits" in predicted:
        _expect(predicted["fits"], "bool", "predicted.fits")
    for key in ("stages", "pipelines", "problems"):
        if key in predicted:
            _expect(predicted[key], "list", f"predicted.{key}")
    for i, stage in enumerate(predicted.get("stages", [])):
        _check_predicted_stage(stage, f"predicted.stages.{i}")
    _check_not_negative(predicted, _PREDICTED_REQUIRED + _PREDICTED_NUMBERS, "predicted")
    _check_not_negative(predicted.get("dollars") or {}, _DOLLAR_NUMBERS, "predicted.dollars")
    return predicted


def _check_groups(outer: OuterSync, pipelines: int, layers: int) -> None:
    """The groups cover pipelines 0..pipelines-1 once each, as consecutive runs in order; the fragments are at
    most the model's layers."""
    expected = 0
    for g, group in enumerate(outer.groups):
        want = list(range(expected, expected + len(group.pipelines)))
        if group.pipelines != want:
            raise ValueError(f"outer_sync.groups.{g}.pipelines must be {want} (groups take consecutive pipelines "
                             f"in order), got {group.pipelines}")
        expected += len(group.pipelines)
    if expected != pipelines:
        raise ValueError(f"outer_sync.groups cover {expected} pipelines, the plan has {pipelines}")
    if outer.fragments > layers:
        raise ValueError(f"outer_sync.fragments {outer.fragments} exceeds the model's {layers} layers")


@dataclass(frozen=True)
class RankInfo:
    """One process of a plan: where it sits (pipeline, stage, TP rank) and which device it drives."""

    rank: int
    pipeline: int
    stage: int
    tp_rank: int
    device: str


class Plan(_Strict):
    """An asymmetric layout plus the cost model's predictions for it."""

    schema_: Literal["flashflex.plan/1"] = Field(PLAN_SCHEMA, alias="schema")
    inputs: PlanInputs
    pipelines: list[PipelinePlan] = Field(min_length=1)
    unused_devices: list[UnusedDevice] = []
    outer_sync: OuterSync | None = None
    predicted: dict[str, Any] | None = None

    _predicted = field_validator("predicted")(check_predicted)

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        model, train = self.inputs.model, self.inputs.train
        seen: set[str] = set()
        batch = 0
        for p, pipe in enumerate(self.pipelines):
            expected_start = 0
            for s, stage in enumerate(pipe.stages):
                where = f"pipelines.{p}.stages.{s}"
                if stage.layers[0] != expected_start:
                    raise ValueError(f"{where}: layers start at {stage.layers[0]}, expected {expected_start}")
                expected_start = stage.layers[1]
                if not model.supports_tp(stage.tp):
                    raise ValueError(
                        f"{where}: tp {stage.tp} must divide num_heads {model.num_heads}, "
                        f"num_kv_heads {model.num_kv_heads} and intermediate_size {model.intermediate_size}"
                    )
                for device in stage.devices:
                    if device in seen:
                        raise ValueError(f"{where}: device {device} is used twice")
                    seen.add(device)
            if expected_start != model.num_layers:
                raise ValueError(f"pipelines.{p}: stages cover layers [0, {expected_start}), "
                                 f"the model has {model.num_layers}")
            batch += pipe.sequences
        if batch != train.global_batch:
            raise ValueError(f"pipelines process {batch} sequences per step, global_batch is {train.global_batch}")
        for unused in self.unused_devices:
            if unused.device in seen:
                raise ValueError(f"unused device {unused.device} is also used by a stage")
        if self.outer_sync is not None:
            _check_groups(self.outer_sync, len(self.pipelines), model.num_layers)
        return self

    def ranks(self) -> list[RankInfo]:
        """Every process of the plan in rank order: pipelines, then stages, then devices."""
        out: list[RankInfo] = []
        for p, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                for t, device in enumerate(stage.devices):
                    out.append(RankInfo(len(out), p, s, t, device))
        return out

    @property
    def world_size(self) -> int:
        """Number of processes (devices used)."""
        return sum(len(stage.devices) for pipe in self.pipelines for stage in pipe.stages)

    def to_json(self) -> str:
        """Stable JSON text of this plan (byte-identical for equal plans)."""
        return dumps_json(self.model_dump(mode="json", by_alias=True, exclude_none=True))


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Load and validate a plan file."""
    return load_model(path, Plan, PLAN_SCHEMA)


def save_plan(path: str | os.PathLike[str], plan: Plan) -> None:
    """Write a plan file atomically."""
    from ..fileio import atomic_write_text

    atomic_write_text(path, plan.to_json())

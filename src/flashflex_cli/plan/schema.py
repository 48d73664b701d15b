"""Plan schema ("flashflex.plan/1"): an asymmetric DP x PP x TP layout, validated on load.

A pipeline is a data-parallel replica: an ordered list of stages covering every transformer layer once.
A stage is a tensor-parallel group: `tp == len(devices)` devices running layers [start, end).
Ranks are numbered pipelines in order, stages in order, devices in order (`Plan.ranks()`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from ..fileio import dumps_json, load_model
from ..model.spec import ModelSpec
from ..physical_limits import (
    DEVICE_MEMORY_BYTES,
    LAYER_INDEX,
    MICRO_BATCHES,
    OVERLAP_STEPS,
    SEED,
    SEQ_LEN,
    SEQUENCES,
    TP_DEGREE,
    limited,
)
from ..semantics.outer_sync import OUTER_LR, OUTER_MOMENTUM
from ..semantics.runtime_paths import OptimizerPath, RuntimeOptions
from ..units import byte_size
from .predicted import Predicted, prediction_problem

PLAN_SCHEMA = "flashflex.plan/1"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


# Counts within the size limits of physical_limits.py (a string, a boolean or a huge integer is refused)
Sequences = limited(SEQUENCES)
SeqLen = limited(SEQ_LEN)
TpDegree = limited(TP_DEGREE)
LayerIndex = limited(LAYER_INDEX)
Seed = limited(SEED)
MicroBatches = limited(MICRO_BATCHES)
OverlapSteps = limited(OVERLAP_STEPS)
# The fewest bytes a token's hidden state takes (16-bit), to refuse a micro-batch no device could hold
HIDDEN_STATE_BYTES = 2


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
    num_micro_batches: MicroBatches
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
    `overlap_steps` (tau): inner steps each fragment's exchange overlaps before its outer step is applied (0: the
    exchange blocks, as without it); `merge_alpha`: then parameter = alpha * local + (1 - alpha) * global (0: the
    global ones replace the tau local steps). Both are left out of the file at their defaults.
    `reason`: why the planner chose it (traffic saved, the quality evidence); absent in hand-written plans."""

    groups: list[ReplicaGroup] = Field(min_length=1)
    optimizer: OuterOptimizer = OuterOptimizer()
    compression: Literal["fp32", "bf16", "int8"] = "bf16"
    fragments: LayerIndex = 1
    overlap_steps: OverlapSteps = 0
    merge_alpha: float = Field(0.0, ge=0.0, lt=1.0)
    reason: str | None = None

    @model_validator(mode="after")
    def _schedule(self) -> OuterSync:
        if self.fragments < 1:
            raise ValueError(f"fragments must be at least 1, got {self.fragments}")
        for g, group in enumerate(self.groups):
            if self.overlap_steps * self.fragments >= group.inner_steps:
                raise ValueError(f"overlap_steps {self.overlap_steps} must be below group {g}'s inner_steps / "
                                 f"fragments = {group.inner_steps}/{self.fragments} (an exchange must end before "
                                 "the next fragment's begins)")
        if self.merge_alpha > 0 and self.overlap_steps == 0:
            raise ValueError(f"merge_alpha {self.merge_alpha:g} needs overlap_steps > 0 (without overlap the "
                             "global parameters replace the local ones)")
        return self

    @model_serializer(mode="wrap")
    def _drop_overlap_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The fields, without overlap_steps 0 and merge_alpha 0 (plans written before them stay byte-identical)."""
        data: dict[str, Any] = handler(self)
        for key, default in (("overlap_steps", 0), ("merge_alpha", 0.0)):
            if data.get(key) == default:
                del data[key]
        return data


class UnusedDevice(_Strict):
    """A device the plan leaves idle, and why."""

    device: str
    reason: str


class PlannedPaths(_Strict):
    """The runtime switches a plan was predicted for (`flashflex plan --no-compile ...`: semantics/runtime_paths.py
    RuntimeOptions); `flashflex show` and `flashflex launch` take them unless told otherwise. A plan predicted
    for the launch defaults has none (its file keeps the bytes it had before the switches were recorded)."""

    lean_p2p: bool = True
    overlap_dp: bool = True
    hierarchical_dp: bool = True
    compile: bool | None = None
    chunked_loss: bool = True
    optimizer: OptimizerPath = "auto"
    cast_once: bool | None = None  # None: off (the launch default), not written, so older plans keep their bytes

    def options(self) -> RuntimeOptions:
        """These switches as the runtime's options."""
        return RuntimeOptions(**{**self.model_dump(), "cast_once": bool(self.cast_once)})

    @classmethod
    def of(cls, options: RuntimeOptions) -> PlannedPaths | None:
        """The record of the switches `plan` and `show` take in `options`; None when they are the launch defaults
        (nothing is written). The runtime's other settings (loss kernel, compile scope) are charged alike by the
        cost model: set by `flashflex launch` or the run configuration, not predicted for by a plan."""
        recorded = {name: value for name, value in dataclasses.asdict(options).items() if name in cls.model_fields}
        recorded["cast_once"] = recorded["cast_once"] or None
        return None if recorded == cls().model_dump() else cls(**recorded)


class PlanInputs(_Strict):
    """What the plan was made from: the cluster (by hash), the model, the training configuration, and the
    sha256 of every measured layer profile its prediction used (absent: none, or an earlier version).
    cluster_path: the cluster file as `flashflex plan` was given it (absent in older plans); `flashflex launch`
    without --cluster opens it and still checks its sha256.
    dtype_reason: why `flashflex plan --dtype auto` chose `train.dtype` (absent: the dtype was given).
    runtime: the runtime switches the prediction is for (absent: the launch defaults).
    shard_optimizer: the `flashflex plan --shard-optimizer` mode the layout was searched with, which an elastic
    re-plan repeats (absent: auto, the planner's default, or a hand-written plan)."""

    cluster_sha256: str
    cluster_name: str = ""
    model: ModelSpec
    train: TrainConfig
    strategy: str = "manual"
    seed: Seed = 0
    layer_profiles: list[str] | None = None
    cluster_path: str | None = None
    dtype_reason: str | None = None
    runtime: PlannedPaths | None = None
    shard_optimizer: Literal["auto", "on", "off"] | None = None

    def runtime_options(self) -> RuntimeOptions:
        """The runtime switches the plan was predicted for (the launch defaults where it records none)."""
        return self.runtime.options() if self.runtime is not None else RuntimeOptions()


def _check_micro_batch_fits_a_device(pipe: PipelinePlan, model: ModelSpec, train: TrainConfig, where: str) -> None:
    """ValueError when one micro-batch's hidden states alone (micro_batch_size x seq_len tokens x hidden_size, 16-bit)
    exceed the largest memory a device may have (physical_limits.DEVICE_MEMORY_BYTES): no device could run it."""
    held = pipe.micro_batch_size * train.seq_len * model.hidden_size * HIDDEN_STATE_BYTES
    if held > DEVICE_MEMORY_BYTES.high:
        raise ValueError(f"{where}: micro_batch_size {pipe.micro_batch_size} x seq_len {train.seq_len} tokens hold "
                         f"{byte_size(held)} of hidden states alone (hidden_size {model.hidden_size}, 16-bit), more "
                         f"than any device's memory may be ({byte_size(DEVICE_MEMORY_BYTES.high)})")


class OptimizerSharding(_Strict):
    """The fp32 master weights and AdamW moments split across each slice's data-parallel holders
    (semantics/optimizer_shards.py). `weights`: per rank (rank order), the relative size of its shard in every
    holder set it belongs to (the planner writes the bytes each device has left after its stage, in MiB);
    absent: equal shards. `reason`: why the planner sharded (absent in hand-written plans)."""

    weights: list[int] | None = None
    reason: str | None = None

    @field_validator("weights")
    @classmethod
    def _positive(cls, weights: list[int] | None) -> list[int] | None:
        if weights is not None and any(isinstance(w, bool) or w < 1 for w in weights):
            raise ValueError("optimizer_sharding.weights must be integers of at least 1")
        return weights


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
    optimizer_sharding: OptimizerSharding | None = None  # absent: every replica holds the full optimizer state
    outer_sync: OuterSync | None = None
    predicted: Predicted | None = None

    @field_validator("predicted", mode="wrap")
    @classmethod
    def _prediction(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Predicted | None:
        """The prediction, a refused figure named in one line ("predicted.mfu must be a number, got '0.5'")."""
        try:
            return handler(value)  # type: ignore[no-any-return]
        except ValidationError as exc:
            raise ValueError(prediction_problem(exc)) from None

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Plan:
        """A copy with `update`d fields; a `predicted` given as a mapping (the JSON object, or a prediction's
        fields with some replaced: `{**plan.predicted, "mfu": 0.5}`) becomes the typed prediction."""
        predicted = (update or {}).get("predicted")
        if isinstance(predicted, Mapping) and not isinstance(predicted, Predicted):
            try:
                update = {**(update or {}), "predicted": Predicted.model_validate(dict(predicted))}
            except ValidationError as exc:
                raise ValueError(prediction_problem(exc)) from None
        return super().model_copy(update=update, deep=deep)

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        model, train = self.inputs.model, self.inputs.train
        seen: set[str] = set()
        batch = 0
        for p, pipe in enumerate(self.pipelines):
            _check_micro_batch_fits_a_device(pipe, model, train, f"pipelines.{p}")
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
        weights = self.optimizer_sharding.weights if self.optimizer_sharding is not None else None
        if weights is not None and len(weights) != len(seen):
            raise ValueError(f"optimizer_sharding.weights has {len(weights)} entries, the plan {len(seen)} ranks")
        if self.outer_sync is not None:
            _check_groups(self.outer_sync, len(self.pipelines), model.num_layers)
        if self.outer_sync is not None and self.optimizer_sharding is not None:
            raise ValueError("outer_sync with optimizer_sharding: a plan of replica groups keeps its optimizer state "
                             "unsharded (the two are not combined yet)")
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

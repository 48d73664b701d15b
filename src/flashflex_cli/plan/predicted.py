"""A plan's `predicted` block as typed models: the cost model's figures for the plan (cost/estimate.py writes them,
planner/fleet/economics.py adds the cluster-wide basis and dollars), read by show, diff, the launcher's summary and
the runtime's out-of-memory report.

Every figure is a JSON number (no string, no boolean), finite and at most 1e300 in size (a product or a sum of two
stays finite); times, rates and sizes that show and diff read are not negative. A figure keeps its JSON type (768
stays an integer, 768.0 a float) and an absent field stays absent, so a plan file re-written is byte-identical;
plans written before a field existed load without it.

Each model also reads as the JSON object it holds (a read-only mapping over the fields present: `predicted["mfu"]`,
`"dollars" in predicted`, `{**predicted}`, `predicted.get("fits")`; a stage list holds stage models that read the
same way), and equals a mapping that validates to an equal model (`plan.predicted == estimate.to_predicted()`).
Code reads the fields as attributes. In a plan, a refused figure is reported in one line naming it
(`prediction_problem`: "predicted.stages.1.dtype_not_native_on must be a list, got 'V100-16G'").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from ..physical_limits import shown

LARGEST_FIGURE = 1e300  # above it a product or a sum of two predicted figures overflows a float
PREDICTION_ERROR = "prediction"  # the pydantic error type of a refused figure (its message shows the value)


def _figure(allow_negative: bool) -> Any:
    """A number field: an int or a float as JSON gives it, finite, at most LARGEST_FIGURE in size, and not negative
    unless `allow_negative`."""

    def check(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise PydanticCustomError(PREDICTION_ERROR, f"must be a number, got {shown(value)}")
        if not abs(value) <= LARGEST_FIGURE:
            raise PydanticCustomError(PREDICTION_ERROR, f"must be a finite number, got {shown(value)}")
        if value < 0 and not allow_negative:
            raise PydanticCustomError(PREDICTION_ERROR, f"must not be negative, got {shown(value)}")
        return value

    return Annotated[int | float, BeforeValidator(check)]


# A figure that may be negative (a headroom, a breakdown term rounded below zero) and one that may not.
Figure = _figure(allow_negative=True)
Amount = _figure(allow_negative=False)
Index = Annotated[StrictInt, Field(ge=0)]


class _Prediction(BaseModel):
    """A part of the prediction: frozen, unknown keys refused, readable as the JSON object it holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # whether a null field the file gave is present (kept in the file); otherwise a null field is absent
    _keeps_nulls: ClassVar[bool] = False

    def _present(self) -> list[str]:
        """The fields present, in the order the file writes them."""
        if self._keeps_nulls:
            return [name for name in type(self).model_fields if name in self.model_fields_set]
        return [name for name in type(self).model_fields if getattr(self, name) is not None]

    def __getitem__(self, key: str) -> Any:
        if key not in self._present():
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self._present()

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]  # a mapping's keys, not pydantic's pairs
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def __bool__(self) -> bool:
        return True  # a model, present, whatever it holds (as before it was readable as a mapping)

    def keys(self) -> list[str]:
        """The fields present."""
        return self._present()

    def values(self) -> list[Any]:
        """The values of the fields present."""
        return [getattr(self, name) for name in self._present()]

    def items(self) -> list[tuple[str, Any]]:
        """(field, value) of the fields present."""
        return [(name, getattr(self, name)) for name in self._present()]

    def get(self, key: str, default: Any = None) -> Any:
        """The field's value when present, else `default`."""
        return getattr(self, key) if key in self._present() else default

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping) and not isinstance(other, BaseModel):
            try:
                other = type(self).model_validate(dict(other))
            except ValidationError:
                return False
        return super().__eq__(other)


class PredictedPipeline(_Prediction):
    """One pipeline: its 1F1B time per iteration (s), its idle share, the tokens it processes per iteration."""

    time_s: Figure | None = None
    bubble_fraction: Figure | None = None
    tokens: Figure | None = None


class PredictedStage(_Prediction):
    """One stage: busy time per iteration and its breakdown (s; fwd_s, bwd_s, p2p_s per micro-batch), the DP
    reduction (dp_s, of which dp_exposed_s after the last backward), memory per device (bytes, by part in
    `memory`), the smallest capacity among its devices, the headroom, where the times came from (`source`), and the
    device types lacking the training dtype (absent: none)."""

    pipeline: Index
    stage: Index
    source: StrictStr | None = None
    time_s: Amount | None = None
    fwd_s: Figure | None = None
    bwd_s: Figure | None = None
    tp_comm_s: Figure | None = None
    p2p_s: Figure | None = None
    dp_s: Figure | None = None
    dp_exposed_s: Figure | None = None
    optimizer_s: Figure | None = None
    end_s: Figure | None = None
    memory_bytes: Amount | None = None
    memory_phase: StrictStr | None = None
    memory: dict[str, Figure] | None = None
    memory_capacity_bytes: Amount | None = None
    headroom_bytes: Figure | None = None
    dtype_not_native_on: list[StrictStr] | None = None


class PredictedDollars(_Prediction):
    """What the plan costs (planner/fleet/economics.py): currency, the prices file's sha256, per hour of the devices
    used and of the whole cluster, per million tokens on both bases; null: unknown (kept as null in the file)."""

    currency: StrictStr = ""
    prices_sha256: StrictStr | None = None
    per_hour_used: Amount | None = None
    per_hour_cluster: Amount | None = None
    per_million_tokens_used: Amount | None = None
    per_million_tokens_cluster: Amount | None = None

    _keeps_nulls: ClassVar[bool] = True

    @model_serializer(mode="wrap")
    def _as_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The fields the file gave, nulls included (a plan's writer drops other nulls)."""
        out = handler(self)
        return {name: out.get(name) for name in type(self).model_fields if name in self.model_fields_set}


class PredictedRound(_Prediction):
    """A plan of replica groups (cost/outer_sync.py): the round (s), its inner part (the slowest group's steps, s),
    the outer all-reduce (s) and what of it is exposed (s), each group's inner step (s), the round's tokens, the
    pseudo-gradient bytes all ranks send per round; with `flashflex plan --sync`: the synchronous plan's tokens/s and
    the bytes per token on links between sites of both."""

    round_s: Amount
    inner_s: Amount | None = None
    outer_allreduce_s: Amount | None = None
    outer_exposed_s: Amount | None = None
    group_step_s: list[Amount] | None = None
    round_tokens: Amount | None = None
    outer_bytes_per_round: Amount | None = None
    synchronous_tokens_per_s: Amount | None = None
    cross_bytes_per_token: Amount | None = None
    synchronous_cross_bytes_per_token: Amount | None = None


class Predicted(_Prediction):
    """The cost model's answer for the plan: iteration time (s), tokens/s, MFU over the devices used (a fraction),
    whether it fits in memory, model FLOPs per token, the summed peak FLOP/s of the devices used, the exposed DP
    reduction and the optimizer step (s), per pipeline and per stage figures, problems found; then the cluster-wide
    basis (peak FLOP/s and device count of the whole cluster) and the dollars, when annotated; a plan of replica
    groups, its round (`outer_sync`)."""

    iteration_time_s: Amount
    tokens_per_s: Amount
    mfu: Amount
    fits: StrictBool | None = None
    model_flops_per_token: Amount | None = None
    peak_flops_used: Amount | None = None
    dp_exposed_s: Amount | None = None
    optimizer_s: Amount | None = None
    pipelines: list[PredictedPipeline] | None = None
    stages: list[PredictedStage] | None = None
    problems: list[StrictStr] | None = None
    peak_flops_cluster: Amount | None = None
    devices_cluster: StrictInt | None = None
    dollars: PredictedDollars | None = None
    outer_sync: PredictedRound | None = None

    @property
    def fits_memory(self) -> bool:
        """Whether the plan fits in memory (a prediction that does not say: yes)."""
        return self.fits is not False


# What main's hand-written checks called each JSON type a prediction's field must have, by pydantic error type.
_KINDS = {"int_type": "an integer", "int_from_float": "an integer", "int_parsing": "an integer", "bool_type": "a bool",
          "string_type": "a str", "list_type": "a list", "model_type": "an object", "model_attributes_type": "an object",
          "dict_type": "an object", "float_type": "a number"}
_INTEGERS = ("pipeline", "stage", "devices_cluster")  # the required or integer fields a missing one is named by


def prediction_problem(exc: ValidationError, where: str = "predicted") -> str:
    """The first problem of a prediction refused by pydantic in one line naming the figure: "predicted.mfu must be a
    number, got '0.5'", "predicted.stages.0.pipeline must be an integer, got '0'", "predicted.tokens_per_s must be a
    finite number, got nan"."""
    error = exc.errors()[0]
    loc = [str(part) for part in error["loc"]]
    field = ".".join([where, *loc])
    value = error.get("input")
    kind = error["type"]
    if kind == PREDICTION_ERROR:
        return f"{field} {error['msg']}"
    if kind == "missing":
        value, kind = None, "int_type" if loc and loc[-1] in _INTEGERS else "float_type"
    if kind in _KINDS:
        return f"{field} must be {_KINDS[kind]}, got {value!r}"[:200]
    if kind == "extra_forbidden":
        return f"{field} is no figure of a prediction"
    if kind == "greater_than_equal":
        return f"{field} must be 0 or more, got {shown(value)}"
    return f"{field} {str(error['msg']).replace('Input should be', 'must be', 1)}, got {shown(value)}"[:200]


def as_predicted(value: Predicted | Mapping[str, Any] | None) -> Predicted | None:
    """`value` as the typed model: a model as it is, the JSON object of one (e.g. `Estimate.to_predicted()`)
    validated into it, None as None."""
    if value is None or isinstance(value, Predicted):
        return value
    return Predicted.model_validate(dict(value))

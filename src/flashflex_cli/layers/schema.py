"""Layer profile schema ("flashflex.layers/1"), validated on load; docs/layer-profiles.md describes it.

One file holds measured costs of one model shape on one device type at one sequence length, dtype,
attention implementation and recompute setting, for any set of (micro_batch_size, tp) entries. Times are
seconds per micro-batch on each device of the TP group (TP collectives of a TP group inside one node
included, unless `tp_comm_included` is false: a profiler that times each TP rank's compute alone);
`activation_bytes` is what one micro-batch keeps on each device until its backward. The format
is open so that measurements of other tools can be converted into it; it imports nothing of the cost model.
"""

from __future__ import annotations

import hashlib
import os
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from ..fileio import dumps_json, load_model
from ..model.spec import Depth, ModelSpec, Positions, Vocab, Width
from ..physical_limits import HELD_BYTES, PART_SECONDS, SEQ_LEN, SEQUENCES, TP_DEGREE, limited

LAYERS_SCHEMA = "flashflex.layers/1"
Attention = Literal["flash", "sdpa", "eager"]
ProfileDtype = Literal["bf16", "fp16", "fp32", "tf32"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


Seconds = limited(PART_SECONDS)  # physical_limits.py gives each bound's reason
HeldBytes = limited(HELD_BYTES)
Sequences = limited(SEQUENCES)
SeqLen = limited(SEQ_LEN)
TpDegree = limited(TP_DEGREE)


class ModelShape(_Strict):
    """The shape a profile was measured for: what sets a layer's cost (not its depth or name). The optional
    keys are absent (None) for a plain Llama layer: `head_dim` only where it is not hidden_size / num_heads,
    `attention_bias` (q/k/v biases, Qwen2) only when true, `sliding_window` (keys per query, Mistral) only
    when set; so a Llama profile never matches a Qwen2 or windowed model of the same widths."""

    hidden_size: Width
    num_heads: Depth
    num_kv_heads: Depth
    intermediate_size: Width
    vocab_size: Vocab
    head_dim: Width | None = None
    attention_bias: Literal[True] | None = None
    sliding_window: Positions | None = None

    @classmethod
    def of(cls, model: ModelSpec) -> ModelShape:
        """The shape of `model`."""
        return cls(hidden_size=model.hidden_size, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                   intermediate_size=model.intermediate_size, vocab_size=model.vocab_size,
                   head_dim=model.head_dim_override, attention_bias=True if model.attention_bias else None,
                   sliding_window=model.sliding_window)


class PartCost(_Strict):
    """One part (a transformer layer, the embedding, or the head) for one micro-batch on one device:
    forward and backward seconds, activation bytes kept until the backward."""

    fwd_s: Seconds
    bwd_s: Seconds
    activation_bytes: HeldBytes = 0.0


class ProfileEntry(_Strict):
    """Costs at one (micro_batch_size, tp). `fixed_bytes`: per-device tensor memory that stays allocated beside
    the model's parameters, gradients, optimizer state and activations (library workspaces, rotary tables);
    not the allocator's cache nor the memory outside it (the cost model counts those itself)."""

    micro_batch_size: Sequences
    tp: TpDegree
    layer: PartCost
    embedding: PartCost
    head: PartCost
    fixed_bytes: HeldBytes | None = None


class ProfilePaths(_Strict):
    """The runtime paths a profile was measured on (semantics/runtime_paths.py): compiled parts and how (the compile
    scope the layer part ran under), the chunked loss and its kernel, the weights cast once per step.
    A profile without this object was measured eager with the whole-vocabulary loss (what flashflex ran before
    the paths existed)."""

    compile: bool = False
    chunked_loss: bool = False
    # written by profilers since issue 31 (absent, None: what ran before: per block, cast per micro-batch, the
    # project's loss); the cost model matches profiles by compile and chunked_loss only
    compile_scope: Literal["block", "stage"] | None = None
    cast_once: bool | None = None
    loss_kernel: Literal["own", "torch"] | None = None


class LayerProfile(_Strict):
    """Measured per-layer costs of one model shape on one device type (module docstring).

    tp_comm_included: whether the times of entries at tp > 1 include the TP group's collectives (default
    true); false for tools that measure each rank's compute alone. Written only when false, so profiles
    without it keep their text and sha256. runtime: the runtime paths the times were measured on (absent: eager,
    whole-vocabulary loss); the cost model uses a profile only for stages that run the same paths.
    """

    def paths(self) -> ProfilePaths:
        """The runtime paths the profile was measured on (the legacy ones where it does not say)."""
        return self.runtime or ProfilePaths()

    schema_: Literal["flashflex.layers/1"] = Field(LAYERS_SCHEMA, alias="schema")
    device_type: str = Field(min_length=1)
    model: ModelShape
    seq_len: SeqLen
    dtype: ProfileDtype
    attention: Attention
    recompute: bool = False
    source: str = ""
    tp_comm_included: bool = True
    runtime: ProfilePaths | None = None
    entries: list[ProfileEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_entries(self) -> LayerProfile:
        seen: set[tuple[int, int]] = set()
        for i, entry in enumerate(self.entries):
            key = (entry.micro_batch_size, entry.tp)
            if key in seen:
                raise ValueError(f"entries.{i}: a second entry for micro_batch_size {key[0]}, tp {key[1]}")
            seen.add(key)
        return self

    def fixed_bytes_grow(self) -> bool:
        """True when some TP degree's `fixed_bytes` grow with the micro-batch size (by more than a quarter and
        64 MiB from its smallest to its largest size): what a version before 2026-11-26 wrote, counting the
        allocator's cached blocks, which follow the largest temporaries, as fixed memory."""
        by_tp: dict[int, list[tuple[int, float]]] = {}
        for entry in self.entries:
            if entry.fixed_bytes is not None:
                by_tp.setdefault(entry.tp, []).append((entry.micro_batch_size, entry.fixed_bytes))
        for points in by_tp.values():
            points.sort()
            low, high = points[0][1], points[-1][1]
            if len(points) > 1 and high > 1.25 * low and high - low > 64 * 2**20:
                return True
        return False

    def to_json(self) -> str:
        """Stable JSON text (byte-identical for equal profiles)."""
        default = {"tp_comm_included"} if self.tp_comm_included else None  # the default is not written
        return dumps_json(self.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=default))

    def sha256(self) -> str:
        """Hex sha256 of the stable JSON text: how plans record which profiles they used."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def __hash__(self) -> int:  # frozen, but holds a list: hash the stable text once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(self.to_json())
            object.__setattr__(self, "_hash", cached)
        return cached

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayerProfile) and self.to_json() == other.to_json()


def load_layer_profile(path: str | os.PathLike[str]) -> LayerProfile:
    """Load and validate a layer profile file; bad input raises InputError naming the file and field."""
    return load_model(path, LayerProfile, LAYERS_SCHEMA)


def save_layer_profile(path: str | os.PathLike[str], profile: LayerProfile) -> None:
    """Write a layer profile atomically."""
    from ..fileio import atomic_write_text

    atomic_write_text(path, profile.to_json())

"""ModelSpec: the shape of a Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2), from a preset name or a
Hugging Face config.json (read by model/hf_config.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from ..physical_limits import MODEL_DEPTH, MODEL_WIDTH, NORM_EPS, POSITIONS, RATIO, ROPE_THETA, VOCAB, limited

Family = Literal["llama", "mistral", "qwen2"]
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2")

# Every number of a model shape within the size limits of physical_limits.py (each bound's reason is there)
Width = limited(MODEL_WIDTH)
Depth = limited(MODEL_DEPTH)
Vocab = limited(VOCAB)
Positions = limited(POSITIONS)
RopeTheta = limited(ROPE_THETA)
NormEps = limited(NORM_EPS)
Ratio = limited(RATIO)


class RopeScaling(BaseModel):
    """Llama 3.1 rotary frequency remapping ("llama3"): wavelengths above original_max_position_embeddings /
    low_freq_factor are stretched by `factor`, those below original / high_freq_factor are kept, and the band
    between is interpolated (Meta, Llama 3.1 release, 2024). Wavelengths in tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["llama3"] = "llama3"
    factor: Ratio
    low_freq_factor: Ratio
    high_freq_factor: Ratio
    original_max_position_embeddings: Positions

    @model_validator(mode="after")
    def _band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor {self.high_freq_factor} must exceed low_freq_factor "
                             f"{self.low_freq_factor}")
        return self


# Fields added after plan format 1 was first written: at these values they mean what a plan without them
# meant (a Llama decoder), and they are left out of dumps so such plans and checkpoints stay byte-identical.
_LATER_FIELDS: dict[str, Any] = {"family": "llama", "head_dim_override": None, "attention_bias": False,
                                 "sliding_window": None, "rope_scaling": None, "max_position_embeddings": None}


class ModelSpec(BaseModel):
    """A Llama-family decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

    family: "llama", "mistral" or "qwen2" (what export writes as model_type). head_dim_override: an explicit
    head size (None: hidden_size / num_heads). attention_bias: biases on the q, k and v projections (Qwen2).
    sliding_window: each query attends to at most this many keys, itself included (Mistral; None: all
    earlier keys). rope_scaling: Llama 3.1 frequency remapping. max_position_embeddings: the context length
    the source config declares (informational). tie_embeddings: the output head is the input embedding.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    hidden_size: Width
    num_layers: Depth
    num_heads: Depth
    num_kv_heads: Depth
    intermediate_size: Width
    vocab_size: Vocab
    rope_theta: RopeTheta = 10000.0
    norm_eps: NormEps = 1e-5
    tie_embeddings: bool = False
    family: Family = "llama"
    head_dim_override: Width | None = None
    attention_bias: bool = False
    sliding_window: Positions | None = None
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: Positions | None = None

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.head_dim_override is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError("head dimension must be even for rotary embeddings")
        if self.attention_bias != (self.family == "qwen2"):
            raise ValueError(f"attention_bias {self.attention_bias} does not match family {self.family!r} "
                             "(q/k/v biases are Qwen2's, Llama and Mistral have none)")
        if self.sliding_window is not None and self.family == "llama":
            raise ValueError("sliding_window needs family 'mistral' or 'qwen2' (Llama attends to every earlier "
                             "token)")
        return self

    @model_serializer(mode="wrap")
    def _drop_later_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for key, default in _LATER_FIELDS.items():
            if key in data and data[key] == default:
                del data[key]
        return data

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.head_dim_override or self.hidden_size // self.num_heads

    def supports_tp(self, tp: int) -> bool:
        """True when a TP degree divides query heads, key/value heads and the MLP width."""
        return (
            self.num_heads % tp == 0 and self.num_kv_heads % tp == 0 and self.intermediate_size % tp == 0
        )


def _preset(name: str, h: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, theta: float = 1e4,
            eps: float = 1e-5) -> ModelSpec:
    return ModelSpec(name=name, hidden_size=h, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                     intermediate_size=ffn, vocab_size=vocab, rope_theta=theta, norm_eps=eps)


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # Llama 1/2 (Touvron et al. 2023) and Llama 3 (Meta 2024) published configurations.
        _preset("llama2-7b", 4096, 32, 32, 32, 11008, 32000),
        _preset("llama2-13b", 5120, 40, 40, 40, 13824, 32000),
        _preset("llama-30b", 6656, 60, 52, 52, 17920, 32000, eps=1e-6),
        _preset("llama2-70b", 8192, 80, 64, 8, 28672, 32000),
        _preset("llama3-8b", 4096, 32, 32, 8, 14336, 128256, theta=5e5),
        _preset("llama3-70b", 8192, 80, 64, 8, 28672, 128256, theta=5e5),
        _preset("llama-1b", 2048, 16, 32, 8, 8192, 128256, theta=5e5),  # Llama 3.2 1B shape
        # Small sizes for tests and CPU demos; vocab 256 matches the byte-level tokenizer.
        _preset("llama-tiny", 64, 4, 4, 4, 176, 256),
        _preset("llama-tiny-gqa", 64, 4, 4, 2, 176, 256),
        _preset("llama-small", 256, 8, 8, 4, 688, 256),
        _preset("llama-100m", 768, 12, 12, 12, 2048, 32000),
    )
}

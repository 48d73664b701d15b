"""ModelSpec: the shape of a Llama-family decoder, from a preset name or a Hugging Face config.json."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, ValidationError, model_validator

from ..errors import InputError
from ..fileio import read_json, validation_message


class ModelSpec(BaseModel):
    """A Llama-family decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt
    intermediate_size: PositiveInt
    vocab_size: PositiveInt
    rope_theta: PositiveFloat = 10000.0
    norm_eps: PositiveFloat = 1e-5
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head dimension must be even for rotary embeddings")
        return self

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden_size // self.num_heads

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


def from_hf_config(path: str | os.PathLike[str]) -> ModelSpec:
    """Read a Hugging Face Llama `config.json` into a ModelSpec."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in data]
    if missing:
        raise InputError(f"{path}: not a Llama config, missing {', '.join(missing)}")
    try:
        return ModelSpec(
            name=str(data.get("_name_or_path") or Path(path).parent.name or "hf-model"),
            hidden_size=data["hidden_size"],
            num_layers=data["num_hidden_layers"],
            num_heads=data["num_attention_heads"],
            num_kv_heads=data.get("num_key_value_heads") or data["num_attention_heads"],
            intermediate_size=data["intermediate_size"],
            vocab_size=data["vocab_size"],
            rope_theta=data.get("rope_theta", 10000.0),
            norm_eps=data.get("rms_norm_eps", 1e-5),
            tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        )
    except ValidationError as exc:
        raise InputError(validation_message(str(path), exc)) from None


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, or a path to a Hugging Face config.json."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json") or os.path.sep in name_or_path or Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    raise InputError(f"unknown model {name_or_path!r}; presets: {', '.join(PRESETS)}, or a path to a config.json")

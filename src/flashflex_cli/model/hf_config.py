"""Hugging Face `config.json` <-> ModelSpec for the Llama (2, 3, 3.1), Mistral and Qwen2 families, and
`resolve_model`: a model named by a preset (model/spec.py) or by the path of such a file.

Reading follows what `transformers` (checked against 5.23) builds from the same file, so a config means the
same model here and there:
- every key is read where current and earlier `transformers` versions put it: the rotary base under
  `rope_parameters.rope_theta` (written by 5.x) or top-level `rope_theta`; the scaling under
  `rope_scaling` (4.x; it wins over `rope_parameters` as in 5.x) or `rope_parameters`, its type under
  `rope_type` or the older `type`;
- a key that is absent takes the reference's default for the family (`rms_norm_eps` 1e-6 everywhere,
  Mistral's `num_key_value_heads` 8 and `sliding_window` 4096, Qwen2's `num_key_value_heads` 32; an explicit
  null falls back as the reference's `__post_init__` does);
- a key whose value this model would not honour (another activation, MLP or output biases, dropout, another
  rotary scheme, per-layer windows) is refused with its name and value: one line, InputError (exit 2).
Keys the reference itself ignores for a family (a `sliding_window` in a Llama config) are ignored here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import InputError
from ..fileio import read_json
from .spec import FAMILIES, PRESETS, ModelSpec, RopeScaling


@dataclass(frozen=True)
class _Family:
    """The reference's class defaults of one family where they differ between families."""

    architecture: str
    num_kv_heads: int | None  # None: num_attention_heads
    max_position_embeddings: int
    sliding_window: int | None


_FAMILY = {
    "llama": _Family("LlamaForCausalLM", None, 2048, None),
    "mistral": _Family("MistralForCausalLM", 8, 4096 * 32, 4096),
    "qwen2": _Family("Qwen2ForCausalLM", 32, 32768, 4096),
}
_BY_ARCHITECTURE = {fam.architecture: name for name, fam in _FAMILY.items()}
DEFAULT_THETA = 10000.0
DEFAULT_EPS = 1e-6
SILU = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
# ModelSpec field -> the config key it is read from (for one-line messages that name the file's key)
_KEY_OF = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
           "vocab_size": "vocab_size", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
           "tie_embeddings": "tie_word_embeddings", "head_dim_override": "head_dim",
           "sliding_window": "sliding_window", "rope_scaling": "rope_scaling",
           "max_position_embeddings": "max_position_embeddings"}


def _refuse(path: str | os.PathLike[str], key: str, value: Any, why: str) -> InputError:
    return InputError(f"{path}: {key} {value!r} is not supported: {why}"[:400])


def _family(path: str | os.PathLike[str], data: dict[str, Any]) -> str:
    """model_type, else the first architecture, else "llama" (configs written before model_type existed)."""
    model_type = data.get("model_type")
    if model_type is not None:
        if model_type not in FAMILIES:
            raise _refuse(path, "model_type", model_type, f"flashflex builds {', '.join(FAMILIES)}")
        return str(model_type)
    architectures = data.get("architectures") or []
    if architectures:
        if not isinstance(architectures, list) or not isinstance(architectures[0], str) \
                or architectures[0] not in _BY_ARCHITECTURE:
            raise _refuse(path, "architectures", architectures, f"flashflex builds {', '.join(_BY_ARCHITECTURE)}")
        return _BY_ARCHITECTURE[architectures[0]]
    return "llama"


def _check_unsupported(path: str | os.PathLike[str], data: dict[str, Any], family: str) -> None:
    """Refuse keys whose value the reference would honour and this model cannot."""
    act = data.get("hidden_act", "silu")
    if act not in SILU:
        raise _refuse(path, "hidden_act", act, "the MLP is SwiGLU with silu")
    if family == "llama":
        if data.get("mlp_bias"):
            raise _refuse(path, "mlp_bias", data["mlp_bias"], "the MLP projections have no biases")
        if data.get("attention_bias"):
            raise _refuse(path, "attention_bias", data["attention_bias"],
                          "Llama's attention_bias also adds a bias to o_proj; only Qwen2's q/k/v biases are built")
    dropout = data.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0, None):
        raise _refuse(path, "attention_dropout", dropout, "training runs without dropout")


def _rope_dict(path: str | os.PathLike[str], data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the key it came from, the rotary parameters): `rope_scaling` if set, else `rope_parameters`, else {}."""
    for key in ("rope_scaling", "rope_parameters"):
        value = data.get(key)
        if value is None or value == {}:
            continue
        if not isinstance(value, dict):
            raise _refuse(path, key, value, "expected an object")
        nested = [v for v in value.values() if isinstance(v, dict)]
        if nested:  # one entry per layer type (5.x, models with layer_types): one scheme for all layers only
            if any(v != nested[0] for v in nested) or len(nested) != len(value):
                raise _refuse(path, key, value, "rotary parameters that differ between layers")
            return key, dict(nested[0])
        return key, dict(value)
    return "rope_parameters", {}


def _rope(path: str | os.PathLike[str], data: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, Llama 3.1 scaling or None), read as transformers' RotaryEmbeddingConfigMixin does."""
    key, rope = _rope_dict(path, data)
    theta = rope.get("rope_theta")
    if theta is None:
        theta = data.get("rope_theta")
    theta = DEFAULT_THETA if theta is None else theta
    for where, factor in ((f"{key}.partial_rotary_factor", rope.get("partial_rotary_factor")),
                          ("partial_rotary_factor", data.get("partial_rotary_factor"))):
        if factor not in (None, 1, 1.0):
            raise _refuse(path, where, factor, "rotary embeddings cover the whole head")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise _refuse(path, f"{key}.rope_type", kind, "rotary scaling of type 'llama3' only (or none)")
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if rope.get(k) is None]
    if missing:
        raise InputError(f"{path}: {key} of type 'llama3' lacks {', '.join(missing)}")
    if data.get("original_max_position_embeddings") is not None:  # the reference prefers the top-level key
        original = data["original_max_position_embeddings"]
    else:
        original = rope.get("original_max_position_embeddings") or max_positions
    try:
        scaling = RopeScaling(factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
                              high_freq_factor=rope["high_freq_factor"], original_max_position_embeddings=original)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "values"
        raise InputError(f"{path}: {key}.{where}: {first['msg']}") from None
    return theta, scaling


def _window(path: str | os.PathLike[str], data: dict[str, Any], family: str, layers: int) -> int | None:
    """The attention window every layer uses (None: full causal attention)."""
    fam = _FAMILY[family]
    if family == "llama":
        return None
    window = data.get("sliding_window", fam.sliding_window)
    if family == "mistral":
        return window
    if not data.get("use_sliding_window", False) or window is None:
        return None
    types = data.get("layer_types")
    if types is None:
        first = data.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool):
            raise _refuse(path, "max_window_layers", first, "expected an integer")
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if not isinstance(types, list):
        raise _refuse(path, "layer_types", types, "expected a list")
    sliding = {t == "sliding_attention" for t in types}
    if len(sliding) > 1:
        raise _refuse(path, "max_window_layers" if "layer_types" not in data else "layer_types",
                      data.get("layer_types", data.get("max_window_layers", 28)),
                      "a sliding window on some layers only (use_sliding_window is true)")
    return window if sliding == {True} else None


def config_name(data: dict[str, Any], source: str | os.PathLike[str]) -> str:
    """The model's name: the config's `_name_or_path`, else its file's name ("qwen-small" for qwen-small.json,
    the folder's for a config.json in a folder), else its architecture and shape ("llama-h2048-l16"), so that
    two configs of different shapes never share a name."""
    named = data.get("_name_or_path")
    if isinstance(named, str) and named.strip():
        return named.strip()
    path = Path(source)
    if path.stem and path.stem != "config":
        return path.stem
    if path.parent.name:
        return path.parent.name
    kind = data.get("model_type") or "hf"
    return f"{kind}-h{data.get('hidden_size')}-l{data.get('num_hidden_layers')}"


def spec_from_hf_dict(data: Any, source: str | os.PathLike[str] = "config.json") -> ModelSpec:
    """A ModelSpec from the parsed contents of a config.json (`source` names it in messages)."""
    if not isinstance(data, dict):
        raise InputError(f"{source}: expected a JSON object")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise InputError(f"{source}: not a Llama-family config, missing {', '.join(missing)}")
    family = _family(source, data)
    fam = _FAMILY[family]
    _check_unsupported(source, data, family)
    heads = data["num_attention_heads"]
    kv = data.get("num_key_value_heads", fam.num_kv_heads)
    max_positions = data.get("max_position_embeddings")
    theta, scaling = _rope(source, data, max_positions or fam.max_position_embeddings)
    layers = data["num_hidden_layers"]
    eps = data.get("rms_norm_eps", DEFAULT_EPS)
    fields: dict[str, Any] = {
        "name": config_name(data, source),
        "hidden_size": data["hidden_size"], "num_layers": layers, "num_heads": heads,
        "num_kv_heads": heads if kv is None else kv, "intermediate_size": data["intermediate_size"],
        "vocab_size": data["vocab_size"], "rope_theta": theta, "norm_eps": eps,
        "tie_embeddings": data.get("tie_word_embeddings", False), "family": family,
        "attention_bias": family == "qwen2", "rope_scaling": scaling, "max_position_embeddings": max_positions,
        "sliding_window": _window(source, data, family, layers if isinstance(layers, int) else 0),
    }
    head_dim = data.get("head_dim")
    if head_dim is not None and isinstance(data["hidden_size"], int) and isinstance(heads, int) and heads > 0 \
            and head_dim != data["hidden_size"] // heads:
        fields["head_dim_override"] = head_dim
    try:
        return ModelSpec(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else ""
        key = _KEY_OF.get(field, field or "(values)")
        more = len(exc.errors()) - 1
        suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        shown = f" (got {fields[field]!r})" if field in fields else ""
        msg = str(first["msg"]).removeprefix("Value error, ")
        raise InputError(f"{source}: {key}: {msg}{shown}{suffix}"[:400]) from None


def from_hf_config(path: str | os.PathLike[str]) -> ModelSpec:
    """Read a Hugging Face `config.json` of a Llama, Mistral or Qwen2 model into a ModelSpec."""
    return spec_from_hf_dict(read_json(path), path)


def to_hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The config.json dict `transformers` (4.45+ and 5.x) loads back into the same model: family,
    shapes, rotary base and scaling (under both the 5.x `rope_parameters` and the 4.x `rope_theta` /
    `rope_scaling` keys), window, ties, norm epsilon."""
    fam = _FAMILY[spec.family]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    scaling: dict[str, Any] | None = None
    if spec.rope_scaling is not None:
        s = spec.rope_scaling
        scaling = {"rope_type": s.type, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor,
                   "original_max_position_embeddings": s.original_max_position_embeddings}
        rope = {**scaling, "rope_theta": spec.rope_theta}
    max_positions = spec.max_position_embeddings or fam.max_position_embeddings
    out: dict[str, Any] = {
        "architectures": [fam.architecture], "model_type": spec.family,
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "hidden_act": "silu", "max_position_embeddings": max_positions,
        "rms_norm_eps": spec.norm_eps, "tie_word_embeddings": spec.tie_embeddings,
        "rope_theta": spec.rope_theta, "rope_scaling": scaling, "rope_parameters": rope,
        "attention_dropout": 0.0,
    }
    if spec.family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif spec.family == "mistral":
        out["sliding_window"] = spec.sliding_window
    else:  # qwen2: every layer slides (max_window_layers 0) or none does
        window = spec.sliding_window
        out.update(use_sliding_window=window is not None, sliding_window=window,
                   max_window_layers=0 if window is not None else spec.num_layers)
    return out


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, or a path to a Hugging Face config.json."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if name_or_path.endswith(".json") or os.path.sep in name_or_path or Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    raise InputError(f"unknown model {name_or_path!r}; presets: {', '.join(PRESETS)}, or a path to a config.json")

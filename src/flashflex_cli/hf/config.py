"""The model side of a Hugging Face checkpoint: does its `config.json` describe the plan's model, and the
`config.json` an export writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InputError
from ..model.hf_config import from_hf_config, to_hf_config
from ..model.spec import ModelSpec
from .files import CONFIG

# ModelSpec fields that do not change the network's weights or outputs (max_position_embeddings: informational)
_IGNORED = ("name", "max_position_embeddings")
HF_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def check_config(folder: str | Path, spec: ModelSpec, what: str = "--init-from") -> ModelSpec:
    """The ModelSpec of `folder`/config.json; InputError naming the first field that differs from `spec`."""
    path = Path(folder) / CONFIG
    if not Path(folder).is_dir():
        raise InputError(f"{what} {folder}: no such folder")
    if not path.is_file():
        raise InputError(f"{what} {folder}: no {CONFIG} (expected a Hugging Face checkpoint folder)")
    theirs = from_hf_config(path)
    for field in type(spec).model_fields:
        if field in _IGNORED:
            continue
        mine, other = getattr(spec, field), getattr(theirs, field)
        if mine != other:
            raise InputError(f"{what} {path}: {field} is {other!r}, the plan's model {spec.name!r} has {mine!r}")
    return theirs


def hf_config(spec: ModelSpec, dtype: str, max_positions: int) -> dict[str, Any]:
    """The `config.json` of an export: the model (model/hf_config.py via `to_hf_config`), the weights' dtype
    ("fp32", "bf16", "fp16") and max_position_embeddings (tokens) where the model declares none."""
    config = dict(to_hf_config(spec))
    if spec.max_position_embeddings is None:
        config["max_position_embeddings"] = max(max_positions, int(config.get("max_position_embeddings") or 0))
    config["torch_dtype"] = HF_DTYPES[dtype]
    return config

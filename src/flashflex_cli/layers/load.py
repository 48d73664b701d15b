"""Load several layer profiles for one run of the cost model: each validated, no two for the same key."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from ..errors import InputError
from ..model.spec import ModelSpec
from ..plan.schema import TrainConfig
from ..units import byte_size
from .schema import LayerProfile, ModelShape, load_layer_profile


def profile_identity(profile: LayerProfile) -> tuple:
    """What two profiles must not share: device type, model shape, seq_len, dtype, attention, recompute and the
    runtime paths they were measured on."""
    return (profile.device_type.lower(), profile.model, profile.seq_len, profile.dtype, profile.attention,
            profile.recompute, profile.paths())


def warn(line: str) -> None:
    """One warning line on stderr (the commands' human output goes there)."""
    print(f"warning: {line}", file=sys.stderr)


def load_layer_profiles(paths: Sequence[str | os.PathLike[str]]) -> tuple[LayerProfile, ...]:
    """Load every file of `paths`; two files describing the same thing are an InputError (which one to
    believe would be a guess). A profile whose fixed bytes grow with the micro-batch size gets a warning
    (cost/measured.py leaves the term out)."""
    found: dict[tuple, str] = {}
    out: list[LayerProfile] = []
    for path in paths:
        profile = load_layer_profile(path)
        if profile.fixed_bytes_grow():
            sizes = sorted((e.micro_batch_size, e.fixed_bytes) for e in profile.entries if e.fixed_bytes is not None)
            warn(f"{path}: its fixed_bytes grow with the micro-batch size ({byte_size(sizes[0][1])} at "
                 f"{sizes[0][0]}, {byte_size(sizes[-1][1])} at {sizes[-1][0]}): an earlier flashflex counted the "
                 "allocator's cache there; that term is ignored (re-measure with flashflex profile --model)")
        key = profile_identity(profile)
        if key in found:
            raise InputError(f"{path}: describes the same device type, model shape and settings as {found[key]}")
        found[key] = str(path)
        out.append(profile)
    return tuple(out)


def check_profile_fits(path: str | os.PathLike[str], profile: LayerProfile, model: ModelSpec,
                       train: TrainConfig) -> None:
    """InputError (one line) when `profile` describes another model shape, sequence length, dtype,
    attention or recompute setting than `model` trained under `train`: it could never
    match a stage, and a silent mismatch would leave the plan modelled while the user believes it measured."""
    wanted = {"model shape": ModelShape.of(model), "seq_len": train.seq_len, "dtype": train.dtype,
              "attention": train.attention, "recompute": train.recompute}
    found = {"model shape": profile.model, "seq_len": profile.seq_len, "dtype": profile.dtype,
             "attention": profile.attention, "recompute": profile.recompute}
    for name, value in wanted.items():
        if found[name] != value:
            raise InputError(f"{path}: profiles {name} {_shown(found[name])}, the plan's is {_shown(value)}")


def _shown(value: object) -> object:
    """A value as a message shows it (a pydantic model as its dict)."""
    return value.model_dump(exclude_none=True) if isinstance(value, ModelShape) else value

"""Load several layer profiles for one run of the cost model: each validated, no two for the same key."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..errors import InputError
from .schema import LayerProfile, load_layer_profile


def profile_identity(profile: LayerProfile) -> tuple:
    """What two profiles must not share: device type, model shape, seq_len, dtype, attention, recompute."""
    return (profile.device_type.lower(), profile.model, profile.seq_len, profile.dtype, profile.attention,
            profile.recompute)


def load_layer_profiles(paths: Sequence[str | os.PathLike[str]]) -> tuple[LayerProfile, ...]:
    """Load every file of `paths`; two files describing the same thing are an InputError (which one to
    believe would be a guess)."""
    found: dict[tuple, str] = {}
    out: list[LayerProfile] = []
    for path in paths:
        profile = load_layer_profile(path)
        key = profile_identity(profile)
        if key in found:
            raise InputError(f"{path}: describes the same device type, model shape and settings as {found[key]}")
        found[key] = str(path)
        out.append(profile)
    return tuple(out)

"""Measured layer costs: pick the layer profile that matches a stage and read it at any (micro-batch, tp).

A profile matches a stage's devices when the device type, the model shape, the sequence length, the dtype,
the attention implementation, the recompute setting and the runtime paths (compiled parts, chunked loss) are all
the same (`profile_key`). Inside a profile:
  - between two measured micro-batch sizes at a measured TP degree: linear interpolation (times and bytes
    are affine in the micro-batch size to first order: a + b * mbs);
  - outside them: the least-squares line a + b * mbs over every measured size at that TP degree (slope and
    intercept clamped at 0), marked `extrapolated`;
  - between two measured TP degrees: linear interpolation in 1 / tp (work per device falls as 1 / tp);
  - outside them: the nearest measured degree scaled by tp_near / tp (compute-bound), `extrapolated`.
At a TP degree that was not measured the times hold no (or other) TP collectives: `tp_measured` is False
and cost/compute.py adds the modelled collectives of the real group; likewise at every degree of a profile
whose `tp_comm_included` is false (its times are each rank's compute alone).
Times are for one device of the group at slowdown 1; `emulation_factor` stretches them for emulated devices.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..errors import InputError
from ..hardware.catalog import canonical_name
from ..layers.schema import LayerProfile, ModelShape, PartCost, ProfileEntry
from ..model.spec import ModelSpec
from ..plan.schema import TrainConfig

PARTS = ("layer", "embedding", "head")
QUANTITIES = ("fwd_s", "bwd_s", "activation_bytes")


@dataclass(frozen=True)
class MeasuredCosts:
    """A profile read at one (micro_batch_size, tp): layer, embedding and head costs (seconds per micro-batch
    on one device, bytes kept: layers/schema.PartCost), the fixed bytes (None
    when the profile has none), whether any figure was extrapolated, the profile's sha256, and whether the
    TP degree itself was measured, and whether the profile's times include the TP collectives
    (`tp_comm_included`; `comm_in_times` combines the two: when false the caller models the collectives)."""

    layer: PartCost
    embedding: PartCost
    head: PartCost
    fixed_bytes: float | None
    extrapolated: bool
    sha256: str
    tp_measured: bool = True
    tp_comm_included: bool = True

    @property
    def comm_in_times(self) -> bool:
        """True when the times hold the group's TP collectives (a measured degree of a profile that includes
        them); else the cost model adds its own."""
        return self.tp_measured and self.tp_comm_included

    def scaled(self, factor: float, layer_comm_s: tuple[float, float] = (0.0, 0.0)) -> MeasuredCosts:
        """Compute times multiplied by `factor` (an emulation slowdown stretches compute only); the layer's
        TP collectives `layer_comm_s` (forward, backward seconds, part of the measured times) are left as they
        are. Bytes unchanged."""
        if factor == 1.0:
            return self

        def part(p: PartCost, comm: tuple[float, float] = (0.0, 0.0)) -> PartCost:
            fwd_comm, bwd_comm = min(comm[0], p.fwd_s), min(comm[1], p.bwd_s)
            return PartCost(fwd_s=(p.fwd_s - fwd_comm) * factor + fwd_comm,
                            bwd_s=(p.bwd_s - bwd_comm) * factor + bwd_comm, activation_bytes=p.activation_bytes)

        return MeasuredCosts(part(self.layer, layer_comm_s), part(self.embedding), part(self.head),
                             self.fixed_bytes, self.extrapolated, self.sha256, self.tp_measured,
                             self.tp_comm_included)


def device_type_key(name: str) -> str:
    """The catalog's canonical name of a device type (or the name itself, lower-cased, when uncatalogued)."""
    try:
        return canonical_name(name)
    except InputError:
        return name.lower()


def profile_key(device_type: str, shape: ModelShape, seq_len: int, dtype: str, attention: str,
                recompute: bool, compile_: bool = False, chunked_loss: bool = False) -> tuple:
    """What a profile must share with a stage to describe it: the device type, the model's shape and the
    training settings, and the runtime paths the parts run on (compiled or eager, chunked or whole loss)."""
    return (device_type_key(device_type), shape, seq_len, dtype, attention, recompute, compile_, chunked_loss)


def key_of_profile(profile: LayerProfile) -> tuple:
    """`profile_key` of a profile."""
    paths = profile.paths()
    return profile_key(profile.device_type, profile.model, profile.seq_len, profile.dtype, profile.attention,
                       profile.recompute, paths.compile, paths.chunked_loss)


def find_profile(profiles: Iterable[LayerProfile], device_type: str, model: ModelSpec,
                 train: TrainConfig, compile_: bool = False, chunked_loss: bool = False) -> LayerProfile | None:
    """The profile that matches `device_type` training `model` under `train` on the runtime paths
    (`compile_`, `chunked_loss`: the stage's resolved RuntimeOptions), or None."""
    wanted = profile_key(device_type, ModelShape.of(model), train.seq_len, train.dtype, train.attention,
                         train.recompute, compile_, chunked_loss)
    for profile in profiles:
        if key_of_profile(profile) == wanted:
            return profile
    return None


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through (x, y) points, both clamped at >= 0."""
    if len(points) == 1:
        x, y = points[0]
        return 0.0, y / x
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx)
    intercept = my - slope * mx
    if intercept < 0:  # a negative fixed cost is noise: refit through the origin
        slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
        intercept = 0.0
    return intercept, slope


def _at_mbs(points: Sequence[tuple[float, float]], mbs: float) -> tuple[float, bool]:
    """y at x = mbs from sorted (x, y) points: interpolated inside, fitted line outside (second: extrapolated)."""
    for x, y in points:
        if x == mbs:
            return y, False
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 < mbs < x1:
            return y0 + (y1 - y0) * (mbs - x0) / (x1 - x0), False
    intercept, slope = _line(points)
    return intercept + slope * mbs, True


def _by_tp(entries: Sequence[ProfileEntry]) -> dict[int, list[ProfileEntry]]:
    out: dict[int, list[ProfileEntry]] = {}
    for entry in entries:
        out.setdefault(entry.tp, []).append(entry)
    for group in out.values():
        group.sort(key=lambda e: e.micro_batch_size)
    return out


def _value(entry: ProfileEntry, part: str, quantity: str) -> float:
    cost: PartCost = getattr(entry, part)
    return float(getattr(cost, quantity))


def _read_at_tp(entries: list[ProfileEntry], mbs: int) -> tuple[dict[tuple[str, str], float], float | None, bool]:
    """Every (part, quantity) at `mbs` from one TP degree's entries, the fixed bytes, extrapolated?"""
    values: dict[tuple[str, str], float] = {}
    extrapolated = False
    for part in PARTS:
        for quantity in QUANTITIES:
            points = [(float(e.micro_batch_size), _value(e, part, quantity)) for e in entries]
            values[(part, quantity)], outside = _at_mbs(points, mbs)
            extrapolated |= outside
    fixed = [e.fixed_bytes for e in entries if e.fixed_bytes is not None]
    return values, (max(fixed) if fixed else None), extrapolated


@lru_cache(maxsize=4096)
def read_profile(profile: LayerProfile, mbs: int, tp: int) -> MeasuredCosts:
    """`profile` at micro-batch size `mbs` and TP degree `tp` (module docstring for the rules)."""
    groups = _by_tp(profile.entries)
    degrees = sorted(groups)
    if tp in groups:
        values, fixed, extrapolated = _read_at_tp(groups[tp], mbs)
    else:
        below = [d for d in degrees if d < tp]
        above = [d for d in degrees if d > tp]
        if below and above:
            lo, hi = below[-1], above[0]
            v_lo, f_lo, x_lo = _read_at_tp(groups[lo], mbs)
            v_hi, f_hi, x_hi = _read_at_tp(groups[hi], mbs)
            w = (1 / tp - 1 / hi) / (1 / lo - 1 / hi)  # weight of `lo` in 1/tp space
            values = {k: w * v_lo[k] + (1 - w) * v_hi[k] for k in v_lo}
            fixed = None if f_lo is None or f_hi is None else max(f_lo, f_hi)
            extrapolated = x_lo or x_hi
        else:
            near = below[-1] if below else above[0]
            values, fixed, _ = _read_at_tp(groups[near], mbs)
            values = {k: v * near / tp for k, v in values.items()}
            extrapolated = True
    # derived figures (interpolated, extrapolated, scaled to another TP degree) are not a file's: no file limits
    parts = [PartCost.model_construct(**{q: max(0.0, values[(part, q)]) for q in QUANTITIES}) for part in PARTS]
    if profile.fixed_bytes_grow():  # an earlier version's allocator cache, not fixed memory (layers/load.py warns)
        fixed = None
    return MeasuredCosts(*parts, fixed_bytes=fixed, extrapolated=extrapolated, sha256=profile.sha256(),
                         tp_measured=tp in groups, tp_comm_included=profile.tp_comm_included)

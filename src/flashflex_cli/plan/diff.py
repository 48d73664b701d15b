"""Compare two plans: structural changes and predicted-metric deltas (`flashflex diff`).

Pipelines are compared by position (pipeline i of A with pipeline i of B), stages likewise; the
regression check compares predicted tokens/s (what CI runs as a dry-run plan diff).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..semantics.runtime_paths import non_default_flags
from .outer_text import outer_sync_changes
from .predicted import Predicted
from .schema import Plan
from .text import compact_devices, layer_text, sharding_text

METRICS = ("tokens_per_s", "mfu", "iteration_time_s")
# compared when either plan's prediction has them: MFU over every device of the cluster (from
# `peak_flops_cluster`), and `predicted.dollars` (a prices file's cost per hour and per million tokens)
OPTIONAL_METRICS = ("mfu_cluster", "per_hour_used", "per_hour_cluster", "per_million_tokens_used",
                    "per_million_tokens_cluster")


@dataclass(frozen=True)
class MetricDelta:
    """One predicted metric in A and B; `pct` the relative change in percent (None when A is 0/absent)."""

    name: str
    a: float | None
    b: float | None

    @property
    def delta(self) -> float | None:
        """b - a (None when either is absent)."""
        return None if self.a is None or self.b is None else self.b - self.a

    @property
    def pct(self) -> float | None:
        """(b - a) / a in percent."""
        if self.a is None or self.b is None or self.a == 0:
            return None
        return (self.b - self.a) / self.a * 100.0


@dataclass
class PlanDiff:
    """Structural changes (one line each) and metric deltas from plan A to plan B."""

    changes: list[str] = field(default_factory=list)
    metrics: list[MetricDelta] = field(default_factory=list)

    def metric(self, name: str) -> MetricDelta:
        """The delta of one metric by name."""
        return next(m for m in self.metrics if m.name == name)

    def regression_pct(self) -> float | None:
        """How much predicted tokens/s fell, in percent (negative or 0 when it rose); None if unknown: absent,
        NaN or infinite in either plan, or 0 in A."""
        pct = self.metric("tokens_per_s").pct
        return None if pct is None or not math.isfinite(pct) else -pct

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form for `--json`."""
        return {
            "changes": list(self.changes),
            "metrics": {m.name: {"a": _json_number(m.a), "b": _json_number(m.b), "delta": _json_number(m.delta),
                                 "pct": _json_number(m.pct)} for m in self.metrics},
            "identical": not self.changes and all(m.delta in (0, 0.0, None) for m in self.metrics),
        }


def _json_number(value: float | None) -> float | None:
    """A float for strict JSON: NaN and infinities become null."""
    return value if value is None or math.isfinite(value) else None


def _stage_text(stage: Any) -> str:
    return f"devices {compact_devices(stage.devices)} tp {stage.tp} layers {layer_text(stage.layers)}"


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    """Structural changes and metric deltas from `a` to `b`."""
    out = PlanDiff()
    ia, ib = a.inputs, b.inputs
    if ia.model != ib.model:
        out.changes.append(f"model: {ia.model.name} -> {ib.model.name}"
                           + (" (same name, different shape)" if ia.model.name == ib.model.name else ""))
    for key, va in ia.train.model_dump().items():
        vb = getattr(ib.train, key)
        if va != vb:
            out.changes.append(f"train.{key}: {va} -> {vb}")
    if ia.cluster_sha256 != ib.cluster_sha256:
        out.changes.append(f"cluster: {ia.cluster_name or '?'} ({ia.cluster_sha256[:12]}) -> "
                           f"{ib.cluster_name or '?'} ({ib.cluster_sha256[:12]})")
    if ia.strategy != ib.strategy:
        out.changes.append(f"strategy: {ia.strategy} -> {ib.strategy}")
    ra, rb = ia.runtime_options(), ib.runtime_options()
    if ra != rb:  # the launch each prediction is for
        out.changes.append(f"runtime switches: {' '.join(non_default_flags(ra)) or 'launch defaults'} -> "
                           f"{' '.join(non_default_flags(rb)) or 'launch defaults'}")
    la, lb = set(ia.layer_profiles or ()), set(ib.layer_profiles or ())
    for sha in sorted(lb - la):
        out.changes.append(f"layer profile {sha[:12]}: now used")
    for sha in sorted(la - lb):
        out.changes.append(f"layer profile {sha[:12]}: no longer used")
    if len(a.pipelines) != len(b.pipelines):
        out.changes.append(f"pipelines: {len(a.pipelines)} -> {len(b.pipelines)}")
    for p in range(max(len(a.pipelines), len(b.pipelines))):
        if p >= len(a.pipelines):
            out.changes.append(f"pipeline {p}: added ({len(b.pipelines[p].stages)} stages, "
                               f"{b.pipelines[p].num_micro_batches} micro-batches)")
            continue
        if p >= len(b.pipelines):
            out.changes.append(f"pipeline {p}: removed ({len(a.pipelines[p].stages)} stages)")
            continue
        pa, pb = a.pipelines[p], b.pipelines[p]
        if (pa.num_micro_batches, pa.micro_batch_size) != (pb.num_micro_batches, pb.micro_batch_size):
            out.changes.append(f"pipeline {p}: micro-batches {pa.num_micro_batches}x{pa.micro_batch_size} -> "
                               f"{pb.num_micro_batches}x{pb.micro_batch_size}")
        if len(pa.stages) != len(pb.stages):
            out.changes.append(f"pipeline {p}: stages {len(pa.stages)} -> {len(pb.stages)}")
        for s in range(max(len(pa.stages), len(pb.stages))):
            sa = pa.stages[s] if s < len(pa.stages) else None
            sb = pb.stages[s] if s < len(pb.stages) else None
            if sa == sb:
                continue
            if sa is None:
                out.changes.append(f"pipeline {p} stage {s}: added ({_stage_text(sb)})")
            elif sb is None:
                out.changes.append(f"pipeline {p} stage {s}: removed ({_stage_text(sa)})")
            else:
                parts = []
                if sa.devices != sb.devices:
                    parts.append(f"devices {compact_devices(sa.devices)} -> {compact_devices(sb.devices)}")
                if sa.tp != sb.tp:
                    parts.append(f"tp {sa.tp} -> {sb.tp}")
                if sa.layers != sb.layers:
                    parts.append(f"layers {layer_text(sa.layers)} -> {layer_text(sb.layers)}")
                out.changes.append(f"pipeline {p} stage {s}: " + "; ".join(parts))
    if a.optimizer_sharding != b.optimizer_sharding:
        out.changes.append(f"optimizer state: {sharding_text(a)} -> {sharding_text(b)}")
    out.changes += outer_sync_changes(a, b)
    ua, ub = [u.device for u in a.unused_devices], [u.device for u in b.unused_devices]
    idle, used = [d for d in ub if d not in ua], [d for d in ua if d not in ub]
    if idle:
        out.changes.append(f"unused: {compact_devices(idle)} now idle")
    if used:
        out.changes.append(f"unused: {compact_devices(used)} now used")
    pa_, pb_ = a.predicted, b.predicted
    for name in METRICS:
        va, vb = (None if p is None else getattr(p, name) for p in (pa_, pb_))
        out.metrics.append(MetricDelta(name, None if va is None else float(va), None if vb is None else float(vb)))
    da, db = (None if p is None else p.dollars for p in (pa_, pb_))
    if da and db and (da.currency, da.prices_sha256) != (db.currency, db.prices_sha256):
        out.changes.append(f"prices: {da.currency or '?'} ({(da.prices_sha256 or '')[:12]}) -> "
                           f"{db.currency or '?'} ({(db.prices_sha256 or '')[:12]})")
    for name in OPTIONAL_METRICS:
        va, vb = optional_metric(pa_, name), optional_metric(pb_, name)
        if va is not None or vb is not None:
            out.metrics.append(MetricDelta(name, va, vb))
    return out


def optional_metric(predicted: Predicted | None, name: str) -> float | None:
    """One of OPTIONAL_METRICS from a prediction; None when it does not carry it."""
    if predicted is None:
        return None
    if name == "mfu_cluster":
        mfu, used, whole = predicted.mfu, predicted.peak_flops_used, predicted.peak_flops_cluster
        return None if not (used and whole) else float(mfu) * float(used) / float(whole)
    value = None if predicted.dollars is None else getattr(predicted.dollars, name)
    return None if value is None else float(value)

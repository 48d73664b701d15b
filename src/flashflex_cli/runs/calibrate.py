"""Fit per-layer forward and backward seconds per device type from a finished run: `flashflex calibrate`.

Output: one `flashflex.layers/1` profile (layers/schema.py) per device type, rather than compute_efficiency
overrides for --cost-params: a profile holds seconds per layer at the run's (micro-batch size, tp), so fixed
per-op costs, kernel choice and the runtime's own overheads are all in it, the cost model uses it as it is
(`--layers`), and it is keyed by model shape, sequence length, dtype and attention, so it is never applied to a
model it does not describe. A single efficiency factor would fold all of that into one number per type.

Per stage, per micro-batch (medians over the run's steps, warm-up left out):
    layer_fwd = ((forward - embedding_fwd - head_fwd - tp_comm_fwd) / slowdown + tp_comm_fwd) / layers
(backward likewise), where embedding (first stage) and head (last stage) are the cost model's predictions
(not separable from the measured stage time), tp_comm is the measured TP all-reduce time (CPU runs only; split
between forward and backward as the cost model splits it), and slowdown the emulation factor of the stage's
slowest device (cluster file), which stretches compute only. So layer_fwd x layers x slowdown + embedding +
head reproduces the measured forward of a stage without TP. Stages are grouped by (device type, micro-batch
size, tp) and the median taken. Embedding and head entries are the predictions divided by the slowdown.
activation_bytes: measured on GPUs ((stage peak memory - the predicted non-activation memory) / (in-flight
micro-batches x layers)); on CPU devices the peak is the process RSS, runtime included, so the analytic count
(model/flops.py layer_activation_bytes) is used. `source` says which.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from ..cost.compute import layer_times
from ..cost.estimate import Estimate, estimate
from ..cost.measured import device_type_key
from ..cost.params import CostParams
from ..errors import InputError
from ..hardware.cluster import Cluster
from ..layers.schema import LayerProfile, ModelShape, PartCost, ProfileEntry, ProfilePaths
from ..model import flops as model_flops
from ..plan.schema import Plan
from .reader import RunRecord

CPU_TYPES = ("cpu", "host")


@dataclass(frozen=True)
class StageFit:
    """One stage's fitted costs per micro-batch on one device at slowdown 1 (seconds; bytes), with what it
    was fitted from: measured forward/backward per micro-batch (s) and the stage's slowdown and layer count."""

    pipeline: int
    stage: int
    device_type: str
    micro_batch_size: int
    tp: int
    layers: int
    slowdown: float
    measured_fwd_s: float
    measured_bwd_s: float
    layer: PartCost
    embedding: PartCost
    head: PartCost
    activation_measured: bool
    clamped: bool


def _tp_split(tp_comm: float, tp_fwd: float, tp_bwd: float) -> tuple[float, float]:
    """Measured TP seconds split between forward and backward in the cost model's proportion."""
    if tp_fwd + tp_bwd <= 0:
        return tp_comm / 2, tp_comm / 2
    return tp_comm * tp_fwd / (tp_fwd + tp_bwd), tp_comm * tp_bwd / (tp_fwd + tp_bwd)


def _activation(plan: Plan, est: Estimate, run: RunRecord, p: int, s: int, on_cpu: bool) -> tuple[float, bool]:
    """Activation bytes per layer and micro-batch on one device, and whether it was measured."""
    model, train, pipe = plan.inputs.model, plan.inputs.train, plan.pipelines[p]
    stage = pipe.stages[s]
    st = next(x for x in est.stages if (x.pipeline, x.stage) == (p, s))
    peak = run.stage_value(p, s, "memory_bytes")
    in_flight = min(len(pipe.stages) - s, pipe.num_micro_batches)
    if not on_cpu and peak is not None and stage.num_layers > 0:
        kept = peak - (st.memory.allocated - st.memory.activations)
        if kept > 0:
            return kept / (in_flight * stage.num_layers), True
    act_dtype = "fp32" if train.dtype in ("fp32", "tf32") else train.dtype
    return model_flops.layer_activation_bytes(model, pipe.micro_batch_size, train.seq_len, stage.tp, act_dtype), False


def stage_fits(plan: Plan, cluster: Cluster, run: RunRecord, params: CostParams | None = None) -> list[StageFit]:
    """A fit per stage whose devices share one type (module docstring for the formulas)."""
    params = params or CostParams()
    model, train = plan.inputs.model, plan.inputs.train
    est = estimate(plan, cluster, params)
    fits = []
    for p, pipe in enumerate(plan.pipelines):
        count = len(pipe.stages)
        for s, stage in enumerate(pipe.stages):
            devices = [cluster.device(d) for d in stage.devices]
            if len({device_type_key(d.type) for d in devices}) != 1 or stage.num_layers == 0:
                continue
            m, slow = pipe.num_micro_batches, max(d.slowdown for d in devices)
            fwd, bwd = run.stage_value(p, s, "forward_s"), run.stage_value(p, s, "backward_s")
            assert fwd is not None and bwd is not None  # the reader requires them
            lt = layer_times(cluster, stage.devices, model, train, params, micro_batch_size=pipe.micro_batch_size)
            extra_f = (lt.embed_fwd_s if s == 0 else 0.0) + (lt.head_fwd_s if s == count - 1 else 0.0)
            extra_b = (lt.embed_bwd_s if s == 0 else 0.0) + (lt.head_bwd_s if s == count - 1 else 0.0)
            tp_f, tp_b = _tp_split((run.stage_value(p, s, "tp_comm_s") or 0.0) / m, lt.tp_fwd_s, lt.tp_bwd_s)
            compute_f, compute_b = fwd / m - extra_f - tp_f, bwd / m - extra_b - tp_b
            on_cpu = devices[0].type.lower() in CPU_TYPES
            act, act_measured = _activation(plan, est, run, p, s, on_cpu)
            n = stage.num_layers
            fits.append(StageFit(
                p, s, devices[0].type, pipe.micro_batch_size, stage.tp, n, slow, fwd / m, bwd / m,
                PartCost(fwd_s=(max(0.0, compute_f) / slow + tp_f) / n, bwd_s=(max(0.0, compute_b) / slow + tp_b) / n,
                         activation_bytes=act),
                PartCost(fwd_s=lt.embed_fwd_s / slow, bwd_s=lt.embed_bwd_s / slow),
                PartCost(fwd_s=lt.head_fwd_s / slow, bwd_s=lt.head_bwd_s / slow),
                act_measured, compute_f < 0 or compute_b < 0))
    return fits


def _median_part(parts: list[PartCost]) -> PartCost:
    return PartCost(fwd_s=statistics.median(x.fwd_s for x in parts), bwd_s=statistics.median(x.bwd_s for x in parts),
                    activation_bytes=statistics.median(x.activation_bytes for x in parts))


def _source(run: RunRecord, fits: list[StageFit]) -> str:
    act = ("measured (peak memory less predicted states)" if all(f.activation_measured for f in fits)
           else "analytic (model/flops.py layer_activation_bytes)")
    text = (f"flashflex calibrate of run {run.path.name}: medians of {len(run.used_rows)} steps (warm-up left "
            f"out) over {len(fits)} stage(s); layer fwd_s/bwd_s measured (stage forward_s/backward_s less the "
            f"predicted embedding/head and the measured TP comm, per layer, divided by the emulation slowdown); "
            f"embedding and head derived from the cost model; activation_bytes {act}")
    if any(f.clamped for f in fits):
        text += "; some stages measured less than the predicted embedding/head: their compute was taken as 0"
    return text


def fit_profiles(plan: Plan, cluster: Cluster, run: RunRecord, params: CostParams | None = None
                 ) -> tuple[list[LayerProfile], list[StageFit]]:
    """One LayerProfile per device type the run used (sorted by type), and the per-stage fits behind them.
    InputError when no stage could be fitted."""
    fits = stage_fits(plan, cluster, run, params)
    if not fits:
        raise InputError(f"{run.path}: no stage of one device type with layers to fit")
    model, train = plan.inputs.model, plan.inputs.train
    on_cuda = any(cluster.device(d).type.lower() not in ("cpu", "host") for info in plan.ranks() for d in [info.device])
    paths = (params or CostParams()).runtime.resolved(on_cuda)  # the run's paths: its profile's
    by_type: dict[str, list[StageFit]] = {}
    for fit in fits:
        by_type.setdefault(device_type_key(fit.device_type), []).append(fit)
    profiles = []
    for key in sorted(by_type):
        group = by_type[key]
        cells: dict[tuple[int, int], list[StageFit]] = {}
        for fit in group:
            cells.setdefault((fit.micro_batch_size, fit.tp), []).append(fit)
        entries = [ProfileEntry(micro_batch_size=mbs, tp=tp, layer=_median_part([f.layer for f in cell]),
                                embedding=_median_part([f.embedding for f in cell]),
                                head=_median_part([f.head for f in cell]))
                   for (mbs, tp), cell in sorted(cells.items())]
        profiles.append(LayerProfile(device_type=group[0].device_type, model=ModelShape.of(model),
                                     seq_len=train.seq_len, dtype=train.dtype, attention=train.attention,
                                     recompute=train.recompute, source=_source(run, group), entries=entries,
                                     runtime=ProfilePaths(compile=bool(paths.compile),
                                                          chunked_loss=paths.chunked_loss)))
    return profiles, fits


def scale_profile(base: LayerProfile, plan: Plan, cluster: Cluster, run: RunRecord,
                  params: CostParams | None = None) -> tuple[LayerProfile, float, float, list[StageFit]]:
    """`base` (a measured layer profile, e.g. from `flashflex profile --model`) with every time scaled by
    what the run measured against it: r_fwd = median over the run's stages of that device type of (fitted
    layer forward / the profile's layer forward at the stage's micro-batch size and TP degree), r_bwd likewise.
    A profile measures a layer alone; a run adds what a layer costs inside a real schedule (the runtime's
    per-op overheads, caches shared with other processes), which this carries to every micro-batch size and
    TP degree of the profile. Returns (scaled profile, r_fwd, r_bwd, the fits used)."""
    from ..cost.measured import read_profile

    params = (params or CostParams()).with_layer_profiles((base,))
    fits = [f for f in stage_fits(plan, cluster, run, params)
            if device_type_key(f.device_type) == device_type_key(base.device_type)]
    if not fits:
        raise InputError(f"{run.path}: no stage on {base.device_type} devices to calibrate the profile with")
    model, train = plan.inputs.model, plan.inputs.train
    if ModelShape.of(model) != base.model or (train.seq_len, train.dtype, train.attention, train.recompute) != (
            base.seq_len, base.dtype, base.attention, base.recompute):
        raise InputError(f"{run.path}: the run trained another model shape or setting than the profile describes")
    fwd, bwd = [], []
    for fit in fits:
        ref = read_profile(base, fit.micro_batch_size, fit.tp).layer
        if ref.fwd_s > 0 and ref.bwd_s > 0:
            fwd.append(fit.layer.fwd_s / ref.fwd_s)
            bwd.append(fit.layer.bwd_s / ref.bwd_s)
    if not fwd:
        raise InputError(f"{base.device_type}: the profile has no positive layer times to scale")
    r_fwd, r_bwd = statistics.median(fwd), statistics.median(bwd)

    def scaled(part: PartCost) -> PartCost:
        return PartCost(fwd_s=part.fwd_s * r_fwd, bwd_s=part.bwd_s * r_bwd, activation_bytes=part.activation_bytes)

    entries = [e.model_copy(update={"layer": scaled(e.layer), "embedding": scaled(e.embedding),
                                    "head": scaled(e.head)}) for e in base.entries]
    source = (f"{base.source}; times scaled by flashflex calibrate of run {run.path.name}: forward x{r_fwd:.4g}, "
              f"backward x{r_bwd:.4g} (medians over {len(fwd)} stage(s))")
    return base.model_copy(update={"entries": entries, "source": source}), r_fwd, r_bwd, fits

"""Compute time of one transformer layer (and of the embedding and head) on one TP group.

Measured first: when every device of the group has a matching layer profile (cost/measured.py), the
profile's times are used as they are (they include the group's TP collectives unless the profile says
`tp_comm_included: false`, then the modelled ones below are added), stretched by the emulation slowdown;
the slowest device sets the pace.
Otherwise modelled, per micro-batch of b sequences (t(b) = a + b * slope, the form of measured layer times):
time = a + FLOPs / tp / (slowest device's achieved FLOP/s) + the group's TP all-reduces, where the fixed
part a = CostParams.intercept x one read of the device's weight shard from memory, split 1:2 between
forward and backward like the FLOPs, and achieved FLOP/s = peak (or measured matmul rate) x slope
efficiency (CostParams.efficiency), with the emulation slowdown applied; a dtype a device lacks (no tensor
cores for it: Device.compute_dtype) is costed at its fp32 peak and fp32 efficiency and intercept.
Megatron-style TP (Shoeybi et al. 2019): per layer two all-reduces of the [b, s, h] activation in the
forward and two in the backward (two more when the backward recomputes the forward); a vocabulary-parallel
embedding all-reduces its output; the head all-reduces the input gradient in the backward and two [b, s]
fp32 statistics of the loss in the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..hardware.cluster import Cluster
from ..layers.schema import LayerProfile
from ..model import flops as F
from ..model.spec import ModelSpec
from ..plan.schema import TrainConfig
from .comm import allreduce_time
from .measured import MeasuredCosts, find_profile, read_profile
from .params import CostParams
from .view import view


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for ONE micro-batch on one TP group.

    fwd_s, bwd_s: one transformer layer, TP all-reduces included (bwd_s includes the recompute
    forward when train.recompute). embed_*: the input embedding (first stage). head_*: final norm,
    output projection and loss (last stage). tp_fwd_s, tp_bwd_s: the all-reduce part of fwd_s, bwd_s.
    """

    fwd_s: float
    bwd_s: float
    embed_fwd_s: float
    embed_bwd_s: float
    head_fwd_s: float
    head_bwd_s: float
    tp_fwd_s: float = 0.0
    tp_bwd_s: float = 0.0
    measured: MeasuredCosts | None = None

    @property
    def source(self) -> str:
        """"measured" (from a layer profile) or "modelled" (analytic)."""
        return "measured" if self.measured is not None else "modelled"

    @property
    def layer_s(self) -> float:
        """One layer, forward + backward (seconds)."""
        return self.fwd_s + self.bwd_s

    @property
    def embed_s(self) -> float:
        """Embedding, forward + backward (seconds)."""
        return self.embed_fwd_s + self.embed_bwd_s

    @property
    def head_s(self) -> float:
        """Final norm, head and loss, forward + backward (seconds)."""
        return self.head_fwd_s + self.head_bwd_s


def group_rate(cluster: Cluster, devices: Sequence[str], dtype: str, params: CostParams) -> float:
    """Achieved FLOP/s of the slowest device of the group (it sets the pace of every TP step)."""
    cv = view(cluster)
    return min(cv.rate(d, dtype, params) for d in devices)


def group_memory_bandwidth(cluster: Cluster, devices: Sequence[str], params: CostParams) -> float:
    """Achieved memory bandwidth (bytes/s) of the group's slowest device for streaming kernels."""
    cv = view(cluster)
    return min(cv.info(d).memory_bandwidth for d in devices) * params.memory_bandwidth_efficiency


def group_measurement(cluster: Cluster, devices: Sequence[str], model: ModelSpec, train: TrainConfig,
                      params: CostParams, mbs: int) -> MeasuredCosts | None:
    """The measured costs of the TP group `devices` at micro-batch size `mbs`: each device's matching
    profile read at (mbs, tp), its compute stretched by its emulation slowdown (the TP collectives inside
    the measured times are not: see `measured_layer_comm`), the slowest device's; None when any device has
    no matching profile."""
    if not params.layer_profiles:
        return None
    cv = view(cluster)
    slowest: MeasuredCosts | None = None
    tp = len(devices)
    for device in devices:
        profile = find_profile(params.layer_profiles, cv.info(device).type, model, train)
        if profile is None:
            return None
        costs = read_profile(profile, mbs, tp)
        slowdown = cv.device(device).slowdown
        if slowdown != 1.0:
            comm = measured_layer_comm(cluster, devices, model, train, params, mbs, profile, costs)
            costs = costs.scaled(slowdown, comm)
        if slowest is None or costs.layer.fwd_s + costs.layer.bwd_s > slowest.layer.fwd_s + slowest.layer.bwd_s:
            slowest = costs
    return slowest


def measured_layer_comm(cluster: Cluster, devices: Sequence[str], model: ModelSpec, train: TrainConfig,
                        params: CostParams, mbs: int, profile: LayerProfile,
                        costs: MeasuredCosts) -> tuple[float, float]:
    """(forward, backward) seconds of TP collectives inside a measured layer time at TP degree t > 1.

    Where the profile also holds TP 1 at this micro-batch size, the collectives are what the TP-t time adds
    to a perfect t-way split of the TP-1 compute: max(0, T_t - T_1 / t). Otherwise the group's modelled
    all-reduces (two forward, two or four backward)."""
    tp = len(devices)
    if tp == 1 or not costs.comm_in_times:
        return 0.0, 0.0
    single = read_profile(profile, mbs, 1)
    if single.tp_measured and not single.extrapolated:
        return (max(0.0, costs.layer.fwd_s - single.layer.fwd_s / tp),
                max(0.0, costs.layer.bwd_s - single.layer.bwd_s / tp))
    ar = allreduce_time(cluster, devices, F.layer_input_bytes(model, mbs, train.seq_len, train.dtype), params)
    return 2 * ar, (4 if train.recompute else 2) * ar


def group_intercept_s(cluster: Cluster, devices: Sequence[str], model: ModelSpec, dtype: str,
                      params: CostParams) -> float:
    """Fixed seconds of one micro-batch through one layer (forward + backward) on the group: the largest
    over its devices of CostParams.intercept x (weight shard bytes / memory bandwidth); may be negative
    (see CostParams.compute_intercept)."""
    cv = view(cluster)
    shard_bytes = F.layer_params_per_device(model, len(devices)) * F.dtype_bytes(dtype)
    worst = float("-inf")
    for device in devices:
        info = cv.info(device)
        computed = cv.compute_dtype(device, dtype)  # a dtype the device lacks runs on its fp32 units
        reads = params.intercept(info.type, computed, measured=bool(cv.device(device).achieved_flops))
        worst = max(worst, reads * shard_bytes / info.memory_bandwidth)
    return worst


def layer_times(cluster: Cluster, devices: Sequence[str], model: ModelSpec, train: TrainConfig,
                params: CostParams, micro_batch_size: int | None = None) -> LayerTimes:
    """Per-micro-batch times of one layer, the embedding and the head on the TP group `devices`.

    `micro_batch_size`: the pipeline's own (default train.micro_batch_size).
    """
    return _layer_times(cluster, tuple(devices), model, train, params, micro_batch_size or train.micro_batch_size)


_CACHE: dict[tuple, tuple[object, LayerTimes]] = {}
_CACHE_LIMIT = 200_000


def _layer_times(cluster: Cluster, devices: tuple[str, ...], model: ModelSpec, train: TrainConfig,
                 params: CostParams, mbs: int) -> LayerTimes:
    cv = view(cluster)
    key = (id(cv), devices, model, train, params, mbs)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is cv:  # the entry holds its view, so the id cannot be reused meanwhile
        return hit[1]
    measured = group_measurement(cluster, devices, model, train, params, mbs)
    if measured is not None:
        found = _measured_times(cluster, devices, model, train, params, mbs, measured)
        _remember(key, cv, found)
        return found
    tp = len(devices)
    seq, dtype = train.seq_len, train.dtype
    rate = group_rate(cluster, devices, dtype, params)
    intercept = group_intercept_s(cluster, devices, model, dtype, params)
    membw = group_memory_bandwidth(cluster, devices, params)
    act = F.layer_input_bytes(model, mbs, seq, dtype)
    ar = allreduce_time(cluster, devices, act, params) if tp > 1 else 0.0

    fwd_flops = F.layer_fwd_flops(model, mbs, seq) / tp
    bwd_flops = F.layer_bwd_flops(model, mbs, seq, train.recompute) / tp
    tp_fwd = 2 * ar
    tp_bwd = (4 if train.recompute else 2) * ar

    # Embedding: a memory-bound gather (read the rows, write [b, s, h]) and its scatter-add backward.
    embed_mem = 2 * act / membw
    embed_fwd = embed_mem + ar
    embed_bwd = embed_mem
    # Head: the [b*s, h] x [h, V/tp] matmul, plus the loss's passes over fp32 logits [b, s, V/tp].
    logits_fp32 = mbs * seq * model.vocab_size / tp * 4
    loss_half = 0.5 * params.loss_passes * logits_fp32 / membw
    stats = allreduce_time(cluster, devices, mbs * seq * 4, params) if tp > 1 else 0.0
    head_fwd = F.head_fwd_flops(model, mbs, seq) / tp / rate + loss_half + 2 * stats
    head_bwd = F.head_bwd_flops(model, mbs, seq) / tp / rate + loss_half + ar
    # a negative intercept (a device whose clocks throttle as batches grow) never halves the slope time
    fwd_compute = max(intercept / 3 + fwd_flops / rate, 0.5 * fwd_flops / rate)
    bwd_fixed = (3 if train.recompute else 2) * intercept / 3  # recompute runs the forward again, fixed part too
    bwd_compute = max(bwd_fixed + bwd_flops / rate, 0.5 * bwd_flops / rate)
    found = LayerTimes(fwd_compute + tp_fwd, bwd_compute + tp_bwd,
                       embed_fwd, embed_bwd, head_fwd, head_bwd, tp_fwd, tp_bwd)
    _remember(key, cv, found)
    return found


def _measured_times(cluster: Cluster, devices: tuple[str, ...], model: ModelSpec, train: TrainConfig,
                    params: CostParams, mbs: int, measured: MeasuredCosts) -> LayerTimes:
    """LayerTimes from a layer profile; where its times hold no TP collectives (a TP degree it did not
    measure, or a profile with `tp_comm_included` false), the group's modelled TP all-reduces are added (two
    per layer forward, two (four with recompute) backward, one in the embedding forward and the head
    backward)."""
    ar = 0.0
    if len(devices) > 1 and not measured.comm_in_times:
        ar = allreduce_time(cluster, devices, F.layer_input_bytes(model, mbs, train.seq_len, train.dtype), params)
    tp_fwd, tp_bwd = 2 * ar, (4 if train.recompute else 2) * ar
    return LayerTimes(measured.layer.fwd_s + tp_fwd, measured.layer.bwd_s + tp_bwd, measured.embedding.fwd_s + ar,
                      measured.embedding.bwd_s, measured.head.fwd_s, measured.head.bwd_s + ar, tp_fwd, tp_bwd,
                      measured=measured)


def _remember(key: tuple, cv: object, found: LayerTimes) -> None:
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[key] = (cv, found)


@lru_cache(maxsize=4096)
def stage_flops_per_micro_batch(model: ModelSpec, train: TrainConfig, num_layers: int, first: bool, last: bool,
                                mbs: int) -> float:
    """Model FLOPs (no recompute) one stage performs per micro-batch, forward + backward, whole TP group."""
    seq = train.seq_len
    total = num_layers * (F.layer_fwd_flops(model, mbs, seq) + F.layer_bwd_flops(model, mbs, seq))
    if last:
        total += F.head_fwd_flops(model, mbs, seq) + F.head_bwd_flops(model, mbs, seq)
    return total

"""Compute time of one transformer layer (and of the embedding and head) on one TP group.

Measured first: when every device of the group has a matching layer profile (cost/measured.py), the
profile's times are used as they are (they include the group's TP collectives), stretched by the emulation
slowdown; the slowest device sets the pace.
Otherwise modelled, per micro-batch, as the runtime runs it (`device_seconds`): a pass of a part (forward or
backward of a layer, the embedding or the head) costs its matrix and attention FLOPs at the device's matmul rate,
the bytes its other operations move at the device's memory bandwidth and a fixed device time per kernel
(cost/traffic.py counts all three for the runtime's paths: eager or compiled, whole-vocabulary or chunked loss),
beside the host's dispatch of each operation: on a GPU the longer of the two, on an emulated CPU device their sum,
with the matrix products' operands (cost/traffic.matmul_operand_bytes) at the memory bandwidth too: one thread
streams them between its arithmetic, where a GPU's compute-bound kernels hide them; and its fused attention runs at
`cpu_attention_efficiency` of the matmul rate (the CPU kernel's small blocked products and online softmax).
The matmul rate is the device's measured matmul rate (`flashflex profile`) x measured_compute_efficiency, or its
dense peak x the matrix-product efficiency derived from measured layers (cost/reference_efficiency.py); a dtype
the device does not compute natively (Device.compute_dtype) at its fp32 peak and fp32 efficiency. Megatron-style
TP (Shoeybi et al. 2019): per layer two all-reduces of the [b, s, h] activation in the forward and two in the
backward (two more when the backward recomputes the forward); a vocabulary-parallel embedding all-reduces its
output; the head all-reduces the input gradient in the backward and two [b, s] fp32 statistics of the loss in the
forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..hardware.cluster import Cluster
from ..layers.schema import LayerProfile
from ..model import flops as model_flops
from ..model.spec import ModelSpec
from ..plan.schema import TrainConfig
from ..semantics.runtime_paths import compute_dtype
from .activations import PartShape
from .comm import allreduce_time
from .measured import MeasuredCosts, find_profile, read_profile
from .memory import is_cuda_group
from .params import CostParams
from .traffic import PassCost, embedding_traffic, head_traffic, layer_traffic, layer_weight_cast
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
    paths = params.runtime.resolved(is_cuda_group(cluster, devices))
    for device in devices:
        profile = find_profile(params.layer_profiles, cv.info(device).type, model, train, bool(paths.compile),
                               paths.chunked_loss)
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
    layer_input = model_flops.layer_input_bytes(model, mbs, train.seq_len, train.dtype)
    ar = allreduce_time(cluster, devices, layer_input, params)
    return 2 * ar, (4 if train.recompute else 2) * ar


def layer_times(cluster: Cluster, devices: Sequence[str], model: ModelSpec, train: TrainConfig,
                params: CostParams, micro_batch_size: int) -> LayerTimes:
    """Per-micro-batch times of one layer, the embedding and the head on the TP group `devices`, for the
    pipeline's micro-batches of `micro_batch_size` sequences."""
    return _layer_times(cluster, tuple(devices), model, train, params, micro_batch_size)


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
    seq = train.seq_len
    act = model_flops.layer_input_bytes(model, mbs, seq, train.dtype)
    ar = allreduce_time(cluster, devices, act, params) if tp > 1 else 0.0
    tp_fwd = 2 * ar
    tp_bwd = (4 if train.recompute else 2) * ar
    stats = allreduce_time(cluster, devices, mbs * seq * 4, params) if tp > 1 else 0.0
    on_cuda = is_cuda_group(cluster, devices)
    paths = params.runtime.resolved(on_cuda)
    part = PartShape(model, tp, mbs, seq, params.compute_dtype or compute_dtype(train.dtype), train.attention,
                     on_cuda, chunked_loss=paths.chunked_loss, loss_chunk=params.loss_chunk_tokens,
                     compiled=bool(paths.compile), cast_once=paths.cast_once)
    layer, embed, head = (layer_traffic(part, train.recompute), embedding_traffic(part), head_traffic(part))
    # the slowest device of the group sets the pace of every part
    slow = [device_seconds(cluster, d, train.dtype, params) for d in devices]
    worst = lambda cost: max(seconds(cost) for seconds in slow)  # noqa: E731
    found = LayerTimes(worst(layer.fwd) + tp_fwd, worst(layer.bwd) + tp_bwd, worst(embed.fwd) + ar,
                       worst(embed.bwd), worst(head.fwd) + 2 * stats, worst(head.bwd) + ar, tp_fwd, tp_bwd)
    _remember(key, cv, found)
    return found


def weight_cast_s(cluster: Cluster, devices: Sequence[str], model: ModelSpec, train: TrainConfig,
                  params: CostParams, num_layers: int) -> float:
    """Seconds a stage of `num_layers` layers on the TP group `devices` casts its layers' weights once per step
    with RuntimeOptions.cast_once (cost/traffic.layer_weight_cast, the slowest device's pace); 0 without it (the
    forwards cast, counted in `layer_times`) and in fp32."""
    if not params.runtime.cast_once:  # (a switch the device does not resolve)
        return 0.0
    on_cuda = is_cuda_group(cluster, devices)
    part = PartShape(model, len(devices), 1, train.seq_len, params.compute_dtype or compute_dtype(train.dtype),
                     train.attention, on_cuda, cast_once=True)
    cast = layer_weight_cast(part)
    return num_layers * max(device_seconds(cluster, d, train.dtype, params)(cast) for d in devices)


def device_seconds(cluster: Cluster, device: str, dtype: str, params: CostParams) -> Callable[[PassCost], float]:
    """Seconds one pass (cost/traffic.PassCost) takes on `device`, emulation slowdown included: its matrix and
    attention FLOPs at the device's matmul rate (`ClusterView.rate`), its other operations' bytes at its memory
    bandwidth (x memory_bandwidth_efficiency), a fixed device time per kernel, and the host's dispatch of every
    operation. A GPU runs asynchronously: the pass takes the longer of the device's work and the host's dispatch
    (the host sets the pace of small micro-batches). An emulated CPU device does both itself, one after the
    other, streams its matrix products' operands from memory too and runs the fused attention's FLOPs at
    `cpu_attention_efficiency` of its matmul rate, stretched by its slowdown."""
    cv = view(cluster)
    info = cv.info(device)
    rate = cv.rate(device, dtype, params)
    bandwidth = info.memory_bandwidth * params.memory_bandwidth_efficiency
    slowdown = cv.device(device).slowdown
    if info.is_cpu:
        per_op = params.cpu_op_seconds * slowdown
        attention_rate = rate * params.cpu_attention_efficiency

        def cpu(cost: PassCost) -> float:
            return (cost.matmul_flops / rate + cost.attention_flops / attention_rate
                    + (cost.bytes + cost.matmul_bytes) / bandwidth + cost.ops * per_op)

        return cpu
    kernel_s, host_op_s = params.kernel_seconds, params.host_op_seconds

    def gpu(cost: PassCost) -> float:
        work = (cost.matmul_flops + cost.attention_flops) / rate + cost.bytes / bandwidth + cost.kernels * kernel_s
        return max(work, cost.ops * host_op_s)

    return gpu


def _measured_times(cluster: Cluster, devices: tuple[str, ...], model: ModelSpec, train: TrainConfig,
                    params: CostParams, mbs: int, measured: MeasuredCosts) -> LayerTimes:
    """LayerTimes from a layer profile; where its times hold no TP collectives (a TP degree it did not
    measure, or a profile with `tp_comm_included` false), the group's modelled TP all-reduces are added (two
    per layer forward, two (four with recompute) backward, one in the embedding forward and the head
    backward)."""
    ar = 0.0
    if len(devices) > 1 and not measured.comm_in_times:
        layer_input = model_flops.layer_input_bytes(model, mbs, train.seq_len, train.dtype)
        ar = allreduce_time(cluster, devices, layer_input, params)
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
    total = num_layers * (model_flops.layer_fwd_flops(model, mbs, seq) + model_flops.layer_bwd_flops(model, mbs, seq))
    if last:
        total += model_flops.head_fwd_flops(model, mbs, seq) + model_flops.head_bwd_flops(model, mbs, seq)
    return total

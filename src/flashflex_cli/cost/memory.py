"""Memory per device of a pipeline stage under 1F1B, and usable device capacity (bytes).

Model states follow ZeRO's accounting for mixed-precision Adam (Rajbhandari et al. 2020): 16-bit
weights and gradients (2 + 2 bytes/param), fp32 master weights (4) and Adam m, v (8); in fp32 training
weights and gradients take 4 bytes each and there is no separate master copy. Activations: see
model/flops.py; 1F1B keeps at most min(S - s, m) micro-batches alive on stage s of S (Narayanan et al.
2021). Full recompute keeps only each layer's input per micro-batch plus one layer's full activations
while it is recomputed. A non-fused (eager) attention also keeps the [b, heads / t, s, s] probabilities
of every layer (Korthikanti et al. 2022, sec. 4.1), dtype bytes + CostParams.eager_score_bytes each
(with a sliding window w < s, its blocks of at most 2w - 1 keys per query: flops.score_pairs).
Families: q/k/v biases are split with their rows (flops.layer_params_per_device); a tied embedding is
held twice, by the first stage and (as the output projection) by the last, so both count it. With a matching layer profile (cost/measured.py) the measured activation bytes per layer, embedding and
head and the measured fixed bytes replace the counted ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ..hardware.cluster import Cluster
from ..model import flops as F
from ..model.spec import ModelSpec
from ..plan.schema import TrainConfig
from .measured import MeasuredCosts
from .params import CostParams
from .view import view


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device of one stage.

    weights, grads, master, optimizer: model states of the stage's transformer layers.
    embedding_head: all model states (weights, grads, master, Adam) of the embedding (first stage) and
    of the final norm and output head (last stage). activations: saved tensors of the in-flight
    micro-batches. logits: one micro-batch's logits on the last stage. reserve: CUDA context, library
    workspaces and communication buffers. dp_buffers: temporaries of the DP gradient reduction (a flat copy
    of the reduced gradients, and the backend's own buffers). total: the sum of all of these.
    embedding_head_weights: the weights' share of embedding_head (already in it and in total; for reports
    that separate weights).
    """

    weights: float
    grads: float
    master: float
    optimizer: float
    activations: float
    embedding_head: float
    logits: float
    reserve: float
    total: float
    embedding_head_weights: float = 0.0
    dp_buffers: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Field name -> bytes, in declaration order."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def state_bytes_per_param(dtype: str, params: CostParams) -> tuple[float, float, float, float]:
    """(weight, gradient, master, optimizer) bytes per parameter for training dtype `dtype`."""
    width = F.dtype_bytes(dtype)
    master = 4.0 if params.master_weights and dtype != "fp32" else 0.0
    return float(width), float(width), master, params.optimizer_state_bytes


def stage_params_per_device(model: ModelSpec, tp: int, num_layers: int, first: bool, last: bool) -> tuple[float, float]:
    """(transformer-layer parameters, embedding/head parameters) one device of the stage holds."""
    extra = 0.0
    if first:
        extra += F.embedding_params(model) / tp
    if last:
        extra += model.hidden_size + F.embedding_params(model) / tp  # final norm + head
    return num_layers * F.layer_params_per_device(model, tp), extra


@lru_cache(maxsize=65536)
def stage_memory(model: ModelSpec, train: TrainConfig, tp: int, num_layers: int, first: bool, last: bool,
                 in_flight: int, params: CostParams, micro_batch_size: int | None = None,
                 reserve_bytes: float | None = None, measured: MeasuredCosts | None = None) -> MemoryBreakdown:
    """Peak bytes per device of a stage of `num_layers` layers at TP degree `tp`.

    in_flight: micro-batches whose activations are alive at once (1F1B: min(S - s, m) on stage s).
    micro_batch_size: the pipeline's own (default train.micro_batch_size).
    reserve_bytes: the device's reserve (default params.memory_reserve_bytes, the GPU figure).
    measured: the group's layer-profile costs at this micro-batch size and TP degree, if any.
    """
    mbs = micro_batch_size or train.micro_batch_size
    seq, dtype = train.seq_len, train.dtype
    w, g, m, o = state_bytes_per_param(dtype, params)
    per_param = w + g + m + o
    layer_params, extra_params = stage_params_per_device(model, tp, num_layers, first, last)

    reserve = params.memory_reserve_bytes if reserve_bytes is None else reserve_bytes
    if measured is not None:
        activations = in_flight * (num_layers * measured.layer.activation_bytes
                                   + (measured.embedding.activation_bytes if first else 0.0))
        logits = in_flight * measured.head.activation_bytes if last else 0.0
        reserve = reserve if measured.fixed_bytes is None else measured.fixed_bytes
    else:
        activations = params.activation_bytes_factor * layer_activations(model, train, tp, num_layers, in_flight,
                                                                         mbs, params)
        logits = F.logits_bytes(model, mbs, seq, tp, dtype) if last else 0.0

    parts = (layer_params * w, layer_params * g, layer_params * m, layer_params * o, activations,
             extra_params * per_param, logits, reserve)
    return MemoryBreakdown(*parts, total=sum(parts), embedding_head_weights=extra_params * w)


def layer_activations(model: ModelSpec, train: TrainConfig, tp: int, num_layers: int, in_flight: int, mbs: int,
                      params: CostParams) -> float:
    """Counted activation bytes per device of `num_layers` layers with `in_flight` micro-batches alive."""
    seq, dtype = train.seq_len, train.dtype
    full_layer = F.layer_activation_bytes(model, mbs, seq, tp, dtype)
    if train.attention == "eager":
        full_layer += F.attention_score_elements(model, mbs, seq, tp) * (F.dtype_bytes(dtype) + params.eager_score_bytes)
    if train.recompute:
        return in_flight * num_layers * F.layer_input_bytes(model, mbs, seq, dtype) + full_layer
    return in_flight * num_layers * full_layer


def with_dp_buffers(mem: MemoryBreakdown, factor: float) -> MemoryBreakdown:
    """`mem` plus the DP reduction's temporaries: `factor` x the stage's gradient bytes (all of them are
    reduced when the stage has DP partners: an upper bound where only some slices are shared)."""
    extra = factor * (mem.grads + mem.embedding_head_weights)  # embedding/head gradients: as wide as weights
    return replace(mem, dp_buffers=extra, total=mem.total + extra)


def device_reserve(cluster: Cluster, device: str, params: CostParams) -> float:
    """Bytes a device holds outside the model: the GPU or the emulated-CPU reserve."""
    return params.cpu_memory_reserve_bytes if view(cluster).info(device).is_cpu else params.memory_reserve_bytes


def device_capacity(cluster: Cluster, device: str, params: CostParams) -> float:
    """Usable bytes of a device: its memory less the allocator's fragmentation share.

    The reserve is not subtracted here: it is a line of MemoryBreakdown.
    """
    return view(cluster).info(device).memory_bytes * (1.0 - params.memory_fragmentation)

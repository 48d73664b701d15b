"""Compute time of one transformer layer (and of the embedding and head) on one TP group.

time = FLOPs / tp / (slowest device's achieved FLOP/s) + the group's TP all-reduces.
Achieved FLOP/s = peak (or measured matmul rate) x efficiency (CostParams.efficiency), with the
emulation slowdown applied. Megatron-style TP (Shoeybi et al. 2019): per layer two all-reduces of the
[b, s, h] activation in the forward and two in the backward (two more when the backward recomputes
the forward); a vocabulary-parallel embedding all-reduces its output; the head all-reduces the input
gradient in the backward and two [b, s] fp32 statistics of the loss in the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from ..hardware.cluster import Cluster
from ..model import flops as F
from ..model.spec import ModelSpec
from ..plan.schema import TrainConfig
from .comm import allreduce_time
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
    tp = len(devices)
    seq, dtype = train.seq_len, train.dtype
    rate = group_rate(cluster, devices, dtype, params)
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
    found = LayerTimes(fwd_flops / rate + tp_fwd, bwd_flops / rate + tp_bwd, embed_fwd, embed_bwd,
                       head_fwd, head_bwd, tp_fwd, tp_bwd)
    if len(_CACHE) >= _CACHE_LIMIT:
        _CACHE.clear()
    _CACHE[key] = (cv, found)
    return found


@lru_cache(maxsize=4096)
def stage_flops_per_micro_batch(model: ModelSpec, train: TrainConfig, num_layers: int, first: bool, last: bool,
                                mbs: int) -> float:
    """Model FLOPs (no recompute) one stage performs per micro-batch, forward + backward, whole TP group."""
    seq = train.seq_len
    total = num_layers * (F.layer_fwd_flops(model, mbs, seq) + F.layer_bwd_flops(model, mbs, seq))
    if last:
        total += F.head_fwd_flops(model, mbs, seq) + F.head_bwd_flops(model, mbs, seq)
    return total

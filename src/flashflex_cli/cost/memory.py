"""Peak memory per device of a pipeline stage, counted the way the runtime allocates it (bytes).

The runtime keeps fp32 parameters (they are the master weights), fp32 gradients and AdamW's fp32 moments, and
computes under autocast (runtime/model/precision.py); cost/activations.py counts what each part of a micro-batch keeps
for its backward and its temporaries. The stage's allocated peak is the largest of these moments of a training
step (1F1B order of semantics/schedule; w warm-up forwards, k = min(w + 1, m) micro-batches in flight of m):

- the first backward, at its start (the head's loss gradient, or the top layer's): parameters and moments, the
  k micro-batches in flight, the start's temporaries; no gradient yet;
- the second backward (m >= 2), at its start: the same with every gradient allocated, min(k, m - 1) in flight,
  and a weight-sized temporary where a gradient is accumulated into an existing one;
- with cast_once, in either backward, a moment later in its top layer: the down projection's weight gradient
  cast to fp32 (h * f * (c + 4) bytes beside the incoming [N, h] fp32 gradient, the product's [N, f] gradient in
  place of the released product) while the stage's working copies stay whole, as long as a later backward
  multiplies by them (activations.layer_backward_transient_bytes; at the step's last backward without recompute
  the down projection's copy is released first, h * f * c bytes less);
- the embedding's backward (first stage), at the end of a backward: its dense weight-sized gradient;
- a steady-state forward, at the top part's largest temporaries;
- the data-parallel reduction (stages with DP partners): every gradient and its flat fp32 copy;
- the optimizer step: parameters, gradients, moments, and the multi-tensor path's temporary as large as the
  parameters (none for the fused kernel: semantics/runtime_paths).
Sends of the pipeline's boundary tensors that no receive follows are waited for at the end of the step, so their
buffers live until then (a copy in the compute dtype on the lean path, else a view that keeps the tensor).

On top of the allocated peak: the caching allocator's slack (`memory_fragmentation` x the peak) and what lives
outside the allocator (`memory_reserve_bytes` per GPU: CUDA context, library handles; plus, per NCCL
communicator the rank holds, counted from the plan exactly as the runtime creates its groups
(semantics/process_groups.communicators), `nccl_channel_bytes` per channel, `communicator_bytes`;
`cpu_memory_reserve_bytes` for an emulated CPU device, whose gloo groups are not charged). A stage fits when that total stays within its device's
memory less the planning margin (`device_capacity`).

With a matching layer profile (cost/measured.py) its measured saved bytes per layer, embedding and head replace
the counted ones, and its fixed bytes (tensors allocated beside the model) are added.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..hardware.cluster import Cluster
from ..model import flops as model_flops
from ..model.spec import ModelSpec
from ..plan.schema import TrainConfig
from ..semantics.optimizer_shards import ShardCounts
from ..semantics.runtime_paths import compute_dtype
from . import activations
from .measured import MeasuredCosts
from .params import CostParams
from .view import view


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device of one stage at its peak moment (`phase`).

    weights: fp32 parameters (transformer layers, embedding and head), with the step's token rows and the rotary
    tables. grads: fp32 gradients allocated at that
    moment. optimizer: AdamW's fp32 moments. activations: what the micro-batches in flight keep for their
    backward (autocast weight copies and held send buffers included). weight_copies: of which the autocast
    copies of the weights. transient: the temporaries of the operation at the peak. dp_buffers: flat fp32
    copies of the gradients being reduced across pipelines. fixed: tensor bytes a layer profile measured beside
    the model. allocated: the sum of these tensor terms (what torch.cuda.max_memory_allocated measures).
    fragmentation: the caching allocator's slack above it. reserve: memory outside the allocator (CUDA context,
    libraries, communication buffers; RSS slack on a CPU device). total: allocated + fragmentation + reserve.
    """

    weights: float
    grads: float
    optimizer: float
    activations: float
    weight_copies: float
    transient: float
    dp_buffers: float
    fixed: float
    allocated: float
    fragmentation: float
    reserve: float
    total: float
    phase: str = "backward"

    def as_dict(self) -> dict[str, float]:
        """Field name -> bytes, in declaration order (the phase left out)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "phase"}


def stage_params_per_device(model: ModelSpec, tp: int, num_layers: int, first: bool, last: bool) -> tuple[float, float]:
    """(transformer-layer parameters, embedding/head parameters) one device of the stage holds. A stage that
    is both first and last with tied embeddings holds the table once."""
    extra = 0.0
    if first:
        extra += model_flops.embedding_params(model) / tp
    if last:
        extra += model.hidden_size
        if not (first and model.tie_embeddings):
            extra += model_flops.embedding_params(model) / tp  # the head, or the last stage's copy of a tied table
    return num_layers * model_flops.layer_params_per_device(model, tp), extra


def decay_params_per_device(model: ModelSpec, tp: int, num_layers: int, first: bool, last: bool) -> float:
    """Parameters of the optimizer's weight-decay group (every matrix) one device of the stage holds."""
    layers, extra = stage_params_per_device(model, tp, num_layers, first, last)
    norms = num_layers * 2 * model.hidden_size + (model.hidden_size if last else 0)
    biases = num_layers * model_flops.layer_bias_params(model) / tp
    return layers + extra - norms - biases


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch's bytes on the stage: kept for the backward (saved), of which autocast weight copies, the
    temporaries at the start of its backward (with and without gradients already allocated), at the embedding's
    backward, and the forward's largest temporaries above what it keeps."""

    saved: float
    copies: float
    bwd_start: float
    bwd_start_accumulating: float
    embedding_bwd: float
    fwd: float


def _micro_batch(p: activations.PartShape, num_layers: int, first: bool, last: bool, recompute: bool,
                 measured: MeasuredCosts | None, activation_factor: float, num_micro: int) -> _MicroBatch:
    """The per-micro-batch terms of a stage (see `_MicroBatch`) in a step of `num_micro` micro-batches: with
    cast_once a layer's working copy outlives the first backward when another follows (`num_micro` >= 2), the
    second when a third follows, and every backward under recompute."""
    if measured is not None:
        layer = measured.layer.activation_bytes
        embedding = measured.embedding.activation_bytes if first else 0.0
        head = measured.head.activation_bytes if last else 0.0
        copies = 0.0  # inside the measured bytes
    else:
        layer = activations.recompute_saved_bytes(p) if recompute else \
            activations.layer_saved_bytes(p) + activations.layer_weight_copies(p)
        embedding = activations.embedding_saved_bytes(p) if first else 0.0
        head = activations.head_saved_bytes(p) + activations.head_weight_copies(p) if last else 0.0
        copies = (0.0 if recompute else num_layers * activations.layer_weight_copies(p)) + \
            (activations.head_weight_copies(p) if last else 0.0)
    boundary = p.tokens * p.h * activations.FP32
    if measured is not None:  # a measured part counts its output, not its input: the stage's input is extra
        held = 0.0 if first else boundary
    else:  # a counted layer holds its input; a non-last stage also holds its output until its backward
        held = 0.0 if last else boundary
    saved = activation_factor * (num_layers * layer + embedding + head) + held
    if recompute and num_layers:
        layer_again = activations.layer_saved_bytes(p) + activations.layer_weight_copies(p) - \
            activations.recompute_saved_bytes(p)
    else:
        layer_again = 0.0
    layer_start = layer_again + activations.layer_backward_transient_bytes(p, copy_kept=recompute or num_micro >= 2)
    layer_accumulating = layer_again + activations.layer_backward_transient_bytes(
        p, accumulating=True, copy_kept=recompute or num_micro >= 3)
    if last:
        # the head's saved tensors are released before the layers' backward starts; its weight's gradient stays
        # when it is the first (it becomes the parameter's), and is added and freed otherwise
        below = activations.head_saved_bytes(p) if num_layers else float("inf")
        head_grad = p.vocab * p.h * activations.FP32
        start = max(activations.head_backward_transient_bytes(p), layer_start - below + head_grad)
        accumulating = max(activations.head_backward_transient_bytes(p, accumulating=True), layer_accumulating - below)
    else:
        start, accumulating = layer_start, layer_accumulating
    fwd_top = activations.head_forward_transient_bytes(p) if last else activations.layer_forward_transient_bytes(p)
    if recompute and measured is None:  # autocast's cache keeps every layer's weight copies until the forward ends
        fwd_top += num_layers * activations.layer_weight_copies(p)
    return _MicroBatch(saved=saved, copies=copies * activation_factor, bwd_start=start,
                       bwd_start_accumulating=accumulating,
                       embedding_bwd=activations.embedding_backward_transient_bytes(p) if first else 0.0, fwd=fwd_top)


@lru_cache(maxsize=65536)
def stage_memory(model: ModelSpec, train: TrainConfig, tp: int, num_layers: int, first: bool, last: bool,
                 in_flight: int, params: CostParams, micro_batch_size: int,
                 reserve_bytes: float | None = None, measured: MeasuredCosts | None = None,
                 num_micro: int | None = None, on_cuda: bool = True, dp_shared: bool = False,
                 warmup: int | None = None, nccl_bytes: float = 0.0,
                 optimizer_shard: ShardCounts = ShardCounts()) -> MemoryBreakdown:
    """Peak bytes per device of a stage of `num_layers` layers at TP degree `tp` (module docstring).

    in_flight: k, micro-batches alive at once (1F1B: min(S - s, m) on stage s of S). num_micro: m, the
    pipeline's micro-batches (None: more than k, the steady state). warmup: forwards before the first backward
    (None: k - 1). micro_batch_size: the pipeline's, in sequences. reserve_bytes: memory
    outside the allocator (default params.memory_reserve_bytes, the GPU figure). measured: the group's layer
    profile at this micro-batch size and TP degree, if any. on_cuda: a GPU stage (the runtime's paths and
    autocast's softmax policy differ on CPU devices). dp_shared: the stage's gradients are reduced across
    pipelines. nccl_bytes: the NCCL communicators a device of the stage holds (cost/estimate.stage_nccl_bytes), added to the
    reserve of a GPU stage. optimizer_shard: with a sharded optimizer (semantics/optimizer_shards.ShardCounts of
    a device of the stage): the moments and the update cover the unsharded parameters and its own pieces; the
    reduction replaces each sharded gradient by its bucket's buffer as it packs it and keeps this device's
    chunks (its pieces' gradients) until the next step.
    """
    paths = params.runtime.resolved(on_cuda)
    mbs = micro_batch_size
    m = num_micro if num_micro is not None else in_flight + 1
    w = warmup if warmup is not None else in_flight - 1
    dtype = params.compute_dtype or compute_dtype(train.dtype)
    p = activations.PartShape(model, tp, mbs, train.seq_len, dtype, train.attention, on_cuda,
                              chunked_loss=paths.chunked_loss, loss_chunk=params.loss_chunk_tokens,
                              compiled=bool(paths.compile), cast_once=paths.cast_once)
    layer_params, extra_params = stage_params_per_device(model, tp, num_layers, first, last)
    n_params = layer_params + extra_params
    held, own = float(optimizer_shard.held), float(optimizer_shard.own)
    kept = n_params - held + own  # parameters whose AdamW state and update live on this device
    weights, grads, moments = 4.0 * n_params, 4.0 * n_params, params.optimizer_state_bytes * kept
    mb = _micro_batch(p, num_layers, first, last, train.recompute, measured, params.activation_bytes_factor, m)

    # boundary sends no receive follows: held until the step ends
    send_bytes = p.tokens * p.h * (p.c if paths.lean_p2p else activations.FP32)
    lone_forward = 0 if last else min(w, m - 1)
    copy_held = lone_forward * send_bytes if paths.lean_p2p and p.autocast else 0.0
    # fp32 sends hold a view: the output of micro-batch 0 outlives its backward when its send was lone
    view_held_after_first = send_bytes if (lone_forward and not copy_held) else 0.0
    lone_backward_first = (not first) and m <= w + 1  # the first backward is followed by another backward
    boundary_width = p.c if paths.lean_p2p and p.autocast else activations.FP32
    back_held = p.tokens * p.h * boundary_width if lone_backward_first else 0.0

    # the step's token rows on the device (int64 [m * mbs, s + 1]) and the stage's rotary tables (2 x [s, head_dim])
    buffers = m * mbs * (train.seq_len + 1) * activations.INT64 + 2 * train.seq_len * model.head_dim * activations.FP32
    weights += buffers
    # cast_once: the stage's one set of working weights, alive from the step's first forward until the last
    # backward has passed each layer (with recompute until the schedule ends), never at the optimizer step
    working = 0.0 if measured is not None else activations.stage_weight_copies(p, num_layers)
    working_at_end = working if train.recompute else 0.0
    candidates: list[tuple[float, str, float, float, float, float]] = []  # (total, phase, grads, acts, transient, dp)
    acts_first = in_flight * mb.saved + copy_held + working
    candidates.append((weights + moments + acts_first + mb.bwd_start, "backward", 0.0, acts_first, mb.bwd_start, 0.0))
    if m >= 2:
        alive = min(in_flight, m - 1)
        acts = alive * mb.saved + copy_held + working + view_held_after_first + back_held
        candidates.append((weights + grads + moments + acts + mb.bwd_start_accumulating, "backward", grads, acts,
                           mb.bwd_start_accumulating, 0.0))
        if first:
            acts_end = (alive - 1) * mb.saved + copy_held + working_at_end + view_held_after_first + back_held
            candidates.append((weights + grads + moments + acts_end + mb.embedding_bwd, "backward", grads, acts_end,
                               mb.embedding_bwd, 0.0))
    fwd_grads = grads if m > w + 1 else 0.0
    acts_fwd = in_flight * mb.saved + copy_held + working
    candidates.append((weights + fwd_grads + moments + acts_fwd + mb.fwd, "forward", fwd_grads, acts_fwd, mb.fwd, 0.0))
    if dp_shared:  # sharded slices: their full gradients go as they are packed, one buffer per bucket
        flat = params.dp_buffer_factor * 4.0 * (n_params - held) + 4.0 * own
        candidates.append((weights + grads + moments + flat + working_at_end, "data-parallel reduction", grads,
                           working_at_end, 0.0, flat))
    optimizer_temp = 4.0 * kept if paths.optimizer == "foreach" else 0.0
    grads_after = 4.0 * kept  # the full gradients of the sharded slices are gone; this rank's chunks stay
    if held > 0:  # the gather of one bucket after the update: its buffer
        bucket = held / max(1, num_layers) if paths.overlap_dp else held
        optimizer_temp = max(optimizer_temp, 4.0 * bucket)
    candidates.append((weights + grads_after + moments + optimizer_temp, "optimizer", grads_after, 0.0,
                       optimizer_temp, 0.0))

    peak, phase, grads_at, acts_at, transient_at, dp_at = max(candidates, key=lambda c: c[0])
    fixed = measured.fixed_bytes if measured is not None and measured.fixed_bytes is not None else 0.0
    allocated = peak + fixed
    reserve = params.memory_reserve_bytes if reserve_bytes is None else reserve_bytes
    if on_cuda:
        reserve += nccl_bytes
    slack = params.memory_fragmentation * allocated
    copies_at = min(acts_at, in_flight * mb.copies + (working if acts_at else 0.0))
    return MemoryBreakdown(weights=weights, grads=grads_at, optimizer=moments, activations=acts_at,
                           weight_copies=copies_at, transient=transient_at, dp_buffers=dp_at, fixed=fixed,
                           allocated=allocated, fragmentation=slack, reserve=reserve,
                           total=allocated + slack + reserve, phase=phase)


def minimum_communicators(tp: int, world: int) -> int:
    """The NCCL communicators every rank of a stage of degree `tp` holds in a plan of `world` ranks, whatever
    the other pipelines are: the default group and the world's duplicate (world >= 2) and its TP group (tp >= 2).
    Its DP and hierarchical groups depend on the whole plan (semantics/process_groups.communicators, which
    `estimate` charges); the planner's per-stage search charges this much."""
    return (2 if world > 1 else 0) + (1 if tp > 1 else 0)


def _channels(cluster: Cluster, devices: list[str] | tuple[str, ...], params: CostParams) -> float:
    """NCCL channels of a communicator over `devices`: NVLink's count when they all sit on one node joined by
    NVLink or xGMI, else the other count (PCIe, or a ring through NICs, which runs few)."""
    nodes = {cluster.split_id(d)[0].name for d in devices}
    if len(nodes) == 1 and cluster.split_id(devices[0])[0].intra_link.kind in ("nvlink", "xgmi"):
        return params.nccl_channels_nvlink
    return params.nccl_channels_other


def communicator_bytes(cluster: Cluster, device: str, params: CostParams) -> float:
    """Bytes one NCCL communicator inside the node of GPU `device` takes there (`nccl_channel_bytes` per channel
    of its fabric); 0 on a CPU device. The planner's per-stage charge; `group_bytes` for a known group."""
    if view(cluster).info(device).is_cpu:
        return 0.0
    return _channels(cluster, [device], params) * params.nccl_channel_bytes


def group_bytes(cluster: Cluster, devices: list[str] | tuple[str, ...], params: CostParams) -> float:
    """Bytes the NCCL communicator over `devices` takes on each of its GPUs (0 when they are CPU devices)."""
    if all(view(cluster).info(d).is_cpu for d in devices):
        return 0.0
    return _channels(cluster, devices, params) * params.nccl_channel_bytes


def device_reserve(cluster: Cluster, device: str, params: CostParams) -> float:
    """Bytes a device holds outside the allocator: the GPU or the emulated-CPU reserve."""
    return params.cpu_memory_reserve_bytes if view(cluster).info(device).is_cpu else params.memory_reserve_bytes


def device_capacity(cluster: Cluster, device: str, params: CostParams) -> float:
    """Bytes of a device a plan may use: its memory less the planning safety margin
    (`memory_safety_margin`). A stage's total (allocated peak, allocator slack, reserve) must stay within it."""
    return view(cluster).info(device).memory_bytes * (1.0 - params.memory_safety_margin)


def is_cuda_group(cluster: Cluster, devices: tuple[str, ...] | list[str]) -> bool:
    """True when the group's devices are GPUs (not emulated CPU devices)."""
    cv = view(cluster)
    return not all(cv.info(d).is_cpu for d in devices)

"""CostParams: every efficiency factor and overhead of the cost model, named, defaulted, sourced.

docs/cost-model.md explains each one. A cluster profile or `--cost-params FILE` overrides any of
them with `CostParams.from_overrides({...})`; an unknown name is an InputError.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..hardware.catalog import CATALOG, canonical_name
from ..layers.schema import LayerProfile
from ..physical_limits import (
    BYTES_PER_ELEMENT,
    BYTES_PER_PARAMETER,
    EFFICIENCY,
    FACTOR,
    HELD_BYTES,
    INTERCEPT,
    OP_SECONDS,
    SHARE,
    Limit,
)
from ..semantics.runtime_paths import RuntimeOptions
from .reference_efficiency import REFERENCE_EFFICIENCY


def _reference_table() -> dict[str, float]:
    return {key: eff for key, (eff, _f, _n) in REFERENCE_EFFICIENCY.items()}


def _reference_intercepts() -> dict[str, float]:
    return {key: factor for key, (_e, factor, _n) in REFERENCE_EFFICIENCY.items()}


def _median_half_precision() -> float:
    return round(statistics.median(e for k, (e, _f, _n) in REFERENCE_EFFICIENCY.items() if k.endswith(":fp16")), 3)


def _median_intercept() -> float:
    return round(statistics.median(f for k, (_e, f, _n) in REFERENCE_EFFICIENCY.items() if k.endswith(":fp16")), 2)


def dtype_class(dtype: str) -> str:
    """The efficiency table's dtype key: "fp32", "tf32", or "fp16" for both 16-bit formats."""
    return dtype if dtype in ("fp32", "tf32") else "fp16"


@dataclass(frozen=True)
class CostParams:
    """Every efficiency factor and overhead of the cost model, named, with defaults and their source.

    compute_efficiency: "DEVICE-TYPE" or "DEVICE-TYPE:fp16|fp32|tf32" -> matrix-product efficiency: the fraction
        of the dense catalog peak a Llama layer's matrix products achieve, the bytes of its other operations
        taken at the memory bandwidth (cost/compute.py). Default: scripts/derive_efficiency.py from the Cephalo
        measurements' fitted slopes; bf16 uses the fp16 figure. A dtype a device lacks is looked up as fp32 (the
        callers pass `Device.compute_dtype`: it runs on the fp32 units).
    compute_intercept: IGNORED (see below); the table's fitted intercepts, for reference.
    default_compute_efficiency: for types absent from the table: the median of the table's fp16 entries.
    default_compute_intercept: likewise, the median of the table's fp16 intercepts.
    tf32_compute_efficiency: for tf32 on types without a tf32 entry: fraction of the TF32 tensor-core peak.
        0.35: an assumption (TF32 matmuls reach about the 16-bit tensor-core efficiency, but the layer's
        elementwise work moves fp32 data at half the 16-bit rate); calibrate it with a layer profile.
    measured_compute_efficiency: for devices whose matmul rate was measured by `flashflex profile` (not a
        datasheet peak): the fraction of that rate a layer's matrix products achieve (its other operations are
        counted apart). 1.0: the recorded H100 layer profile's forward and backward follow the probe's 780.9
        TFLOP/s plus the counted bytes to within 3%; on this machine's CPU the layers' matmuls run at the probe's
        rate within 5% once their operands' traffic is counted apart (cost/traffic.matmul_operand_bytes).
    cpu_attention_efficiency: on an emulated CPU device, the fraction of its matmul rate that the fused attention
        (scaled_dot_product_attention's CPU kernel: blocks of queries against blocks of keys, an online softmax
        between two small products per block) reaches on its FLOPs. 0.3: on this repository's 2-core VM, one pinned
        thread, causal, sequences 128-512, it reached 0.27-0.43 of the probed rate forward and 0.23-0.33 backward
        at head dims 32-128 (0.13-0.27 at 16); scripts/check_cpu_layer_model.py measures it. GPUs' fused
        attention is costed at their matmul rate (the recorded H100 layers follow it within 3%).
    tp_comm_efficiency, p2p_efficiency, dp_comm_efficiency: achieved fraction of a link's bandwidth for
        TP all-reduces, pipeline sends and DP gradient all-reduces. 1.0: link classes already hold
        achieved rates (hardware/links.py).
    dp_overlap: the runtime's overlapped DP reduction (RuntimeOptions.overlap_dp, its default): each layer's
        bucket starts reducing when the stage's last backward has finished that layer (cost/dp.py simulates
        it layer by layer). False: every bucket waits for the end of the backward (`--no-overlap-dp`).
    dp_hierarchical: the runtime's hierarchical DP reduction (RuntimeOptions.hierarchical_dp, its default):
        holders on several nodes reduce inside each node, then across nodes by one leader each (cost/dp.py).
        False: one flat ring over all holders (`--no-hierarchical-dp`).
    dp_overlap_fraction: IGNORED since the overlap is simulated per layer (`dp_overlap`); still accepted,
        in [0, 1), so older cost-parameter files load.
    grad_reduce_bytes: bytes per gradient element in the DP all-reduce. 4: the runtime keeps fp32
        parameters and gradients and computes under autocast (runtime/training/engine.py), as Megatron reduces
        fp32 main gradients.
    activation_transfer_bytes: bytes per element of the activations and gradients sent between pipeline
        stages. 4: the runtime sends them in fp32 (runtime/parallel/pipeline.py).
    memory_bandwidth_efficiency: achieved fraction of a device's memory bandwidth (measured by the probe, or the
        catalog's) for the operations besides matrix products (cost/traffic.py). 0.85: the recorded H100 optimizer
        step moved 92 bytes per parameter for 1.50 G parameters in 53.4 ms, 2.58 TB/s, 0.87 of the probe's 2.97.
    optimizer_bytes_per_param, loss_passes, compute_intercept, default_compute_intercept: IGNORED since the
        optimizer step, the loss and the fixed part of a micro-batch are counted from the runtime's operations
        (cost/traffic.py); still accepted so older cost-parameter files load.
    eager_score_bytes: IGNORED since the attention's saved probabilities are counted from the runtime's operations
        (cost/activations.py); still accepted so older cost-parameter files load.
    layer_profiles: measured layer profiles (flashflex.layers/1); a stage whose devices all match one is
        costed from it (cost/measured.py), else by the analytic model. Not settable from a cost-params file.
    runtime: the runtime's paths the model charges (semantics/runtime_paths.RuntimeOptions: communication
        switches, compile, chunked loss, optimizer); the launch defaults, or a recorded run's runtime.json
        (`flashflex show --run`). Not settable from a cost-params file.
    compute_dtype: the dtype the matmuls ran in, where it differs from the plan's rule (runs recorded on CPU
        before the runtime honoured 16-bit plans there computed in fp32); None: the rule. Not settable from a file.
    loss_chunk_tokens: tokens per chunk of the chunked loss where a run set them (tests); None: the runtime's rule
        (semantics/runtime_paths.loss_chunk_tokens). Not settable from a file.
    master_weights: IGNORED: the runtime's fp32 parameters are its master weights (cost/memory.py); still
        accepted so older cost-parameter files load.
    optimizer_state_bytes: Adam's m and v in fp32 (8 bytes/param), as torch.optim.AdamW keeps them.
    activation_bytes_factor: multiplier on the counted saved tensors (1.0 = exactly what cost/activations.py
        counts the runtime keeps; a calibration knob).
    memory_reserve_bytes: per GPU, memory outside PyTorch's caching allocator other than NCCL's communicators:
        the CUDA context and the cuBLAS/cuDNN handles. 0.5e9: a CUDA 12/13 context with lazy module loading is
        about 0.5 GB; an H100 running out of memory (the recorded llama-1b run at micro-batch 8, expandable
        segments, one rank: no communicator with a peer) reported 71.66 GiB in use by the process of which 69.91
        GiB allocated by PyTorch, the context, libraries and the allocator's unused reserve (`memory_fragmentation`)
        together 1.75 GiB. A layer profile's fixed_bytes adds what it measured allocated beside the model.
    nccl_channel_bytes: per GPU, the memory one channel of one NCCL communicator of two or more ranks takes; a
        communicator takes it once per channel (`nccl_channels_nvlink`, `nccl_channels_other`), and a rank is
        charged once per communicator it holds (semantics/process_groups.communicators: the default group, the
        world's duplicate, its TP group, each DP holder set and hierarchical group it belongs to; the runtime
        creates them all eagerly). 28.9e6, from NCCL's buffer sizes: every channel keeps, per peer connection, a
        FIFO for each protocol: NCCL_BUFFSIZE 4 MiB (Simple), 4.69 MiB (LL128: 120 elements x 640 threads x 8
        steps x 8 bytes) and 0.5 MiB (LL: 8 lines x 512 threads x 8 steps x 16 bytes), 9.19 MiB in all, and a
        ring and a tree connect about 3 peers per channel: 3 x 9.19 MiB.
    nccl_channels_nvlink: channels of a communicator whose GPUs are all on one node joined by NVLink or xGMI: 24. With the figure
        above, 24 x 28.9 MB = 0.69 GB per communicator, which a public measurement confirms: PyTorch on 4 A100s
        over NVLink, one all-reduce per group (NVIDIA/nccl issue 964), 544 MB for a group of 2 GPUs and 688 MB
        for a larger one; NVIDIA/nccl issue 864 sees the same growth with every further communicator.
    nccl_channels_other: channels of a communicator over PCIe or across nodes: 4, an assumption (NCCL sizes its
        channels by the slowest link of its rings; PCIe and NIC rings run a few), 0.12 GB per communicator.
        Unmeasured here.
        CPU devices (gloo) are not charged.
    cpu_memory_reserve_bytes: the same for an emulated CPU device: its peak RSS growth during training beyond
        the counted tensors (allocator and arena slack, gloo buffers). 40 MiB: measured
        here, the median over benchmarks/validate_cost_model.py's plans without DP reduction (19-62 MiB).
    dp_buffer_factor: the flat fp32 copies of the gradients a stage packs for its reduction across pipelines, as a
        multiple of its gradient bytes: 1.0 (runtime/parallel/grad_sync.py packs every shared slice, and the copies live
        until the reduction finishes).
    memory_fragmentation: the caching allocator's slack, as a fraction of the allocated peak (reserved but not
        allocated bytes). 0.03: the recorded H100 out-of-memory (expandable segments) bounds it by 2.5%; without
        expandable segments it can be larger (the launcher sets them).
    host_op_seconds: a GPU host's dispatch of one operation (seconds): the recorded H100 run at micro-batch 1
        dispatched 1,494 forward operations in 19.3 ms while the device kept up (at most 12.9 us each); 10 us.
    cpu_op_seconds: an emulated CPU device's cost per operation beyond its FLOPs and bytes (seconds): 5 us, fitted
        to a measured llama-small layer profile on this machine (one pinned thread). With the products' operands
        and the attention's rate counted, scripts/check_cpu_layer_model.py fits a layer chain alone with its
        element-wise bytes at 1.6x the probe's copy bandwidth (its tensors stay in the caches) and 2.7-7 us;
        5 us is kept because emulated devices sharing a host's cores and caches run their layers 9-15% slower
        than alone (three on two cores), which nothing else charges (docs/cost-model.md, section 2).
    kernel_seconds: the device-side fixed time of one GPU kernel (seconds): 4 us, an assumption (launch latency
        and tail; a few percent at small micro-batches).
    memory_safety_margin: fraction of every device's memory the planner never plans into: a stage fits when its
        total (allocated peak, allocator slack, reserve) stays within memory x (1 - margin). 0.05.
    """

    compute_efficiency: Mapping[str, float] = field(default_factory=_reference_table)
    compute_intercept: Mapping[str, float] = field(default_factory=_reference_intercepts)
    default_compute_efficiency: float = field(default_factory=_median_half_precision)
    default_compute_intercept: float = field(default_factory=_median_intercept)
    tf32_compute_efficiency: float = 0.35
    measured_compute_efficiency: float = 1.0
    cpu_attention_efficiency: float = 0.3
    tp_comm_efficiency: float = 1.0
    p2p_efficiency: float = 1.0
    dp_comm_efficiency: float = 1.0
    dp_overlap: bool = True
    dp_hierarchical: bool = True
    dp_overlap_fraction: float = 0.0
    grad_reduce_bytes: float = 4.0
    activation_transfer_bytes: float = 4.0
    memory_bandwidth_efficiency: float = 0.85
    optimizer_bytes_per_param: float = 28.0
    loss_passes: float = 4.0
    master_weights: bool = True
    optimizer_state_bytes: float = 8.0
    activation_bytes_factor: float = 1.0
    eager_score_bytes: float = 0.25
    memory_reserve_bytes: float = 0.5e9
    nccl_channel_bytes: float = 28.9e6
    nccl_channels_nvlink: float = 24.0
    nccl_channels_other: float = 4.0
    cpu_memory_reserve_bytes: float = 40 * 2**20
    dp_buffer_factor: float = 1.0
    memory_fragmentation: float = 0.03
    memory_safety_margin: float = 0.05
    host_op_seconds: float = 10e-6
    cpu_op_seconds: float = 5e-6
    kernel_seconds: float = 4e-6
    layer_profiles: tuple[LayerProfile, ...] = ()
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    compute_dtype: str | None = None
    loss_chunk_tokens: int | None = None

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:  # computed once: params are hashed in every cache lookup of the hot path
            maps = ("compute_efficiency", "compute_intercept")
            values = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in maps]
            cached = hash((*(tuple(sorted(getattr(self, m).items())) for m in maps), *values))
            object.__setattr__(self, "_hash", cached)
        return cached

    def efficiency(self, device_type: str, dtype: str, measured: bool = False) -> float:
        """Fraction of the peak FLOP/s a transformer layer achieves on `device_type` for `dtype`.

        `measured`: the device's peak is a measured matmul rate (Device.source == "measured").
        """
        if measured:
            return self.measured_compute_efficiency
        table = self.compute_efficiency
        key = f"{device_type}:{dtype_class(dtype)}"
        if key in table:
            return table[key]
        if device_type in table:
            return table[device_type]
        return self.tf32_compute_efficiency if dtype == "tf32" else self.default_compute_efficiency

    def intercept(self, device_type: str, dtype: str, measured: bool = False) -> float:
        """Fixed time of one micro-batch through a layer, in reads of the layer's weights (see the class).

        `measured`: the device's rate is a measured matmul rate; its layer overheads are not known: 0.
        """
        if measured:
            return 0.0
        table = self.compute_intercept
        for key in (f"{device_type}:{dtype_class(dtype)}", device_type):
            if key in table:
                return table[key]
        return self.default_compute_intercept

    def for_launch(self, runtime: RuntimeOptions) -> CostParams:
        """These parameters charging a launch on `runtime`'s paths (`flashflex plan/show/launch` switches): its
        communication switches turned off turn the DP overlap and hierarchy off (a cost-parameter file's
        `dp_overlap: false` stays off)."""
        return dataclasses.replace(self, runtime=runtime, dp_overlap=self.dp_overlap and runtime.overlap_dp,
                                   dp_hierarchical=self.dp_hierarchical and runtime.hierarchical_dp)

    def with_layer_profiles(self, profiles: tuple[LayerProfile, ...]) -> CostParams:
        """These parameters with `profiles` as the measured layer profiles."""
        return dataclasses.replace(self, layer_profiles=tuple(profiles))

    @classmethod
    def from_overrides(cls, overrides: Mapping[str, Any]) -> CostParams:
        """Defaults with `overrides` applied; an unknown name or a bad value raises InputError."""
        if not isinstance(overrides, Mapping):
            raise InputError("cost parameters: expected a JSON object of name -> value")
        names = {f.name: f for f in dataclasses.fields(cls) if f.name not in NOT_IN_FILES}
        base = cls()
        values: dict[str, Any] = {}
        for name, value in overrides.items():
            if name not in names:
                raise InputError(f"cost parameters: unknown name {name!r}; known: {', '.join(sorted(names))}")
            if name == "compute_efficiency":
                values[name] = {**base.compute_efficiency, **_efficiency_overrides(value)}
            elif name == "compute_intercept":
                values[name] = {**base.compute_intercept, **_efficiency_overrides(value, name)}
            elif name in ("master_weights", "dp_overlap", "dp_hierarchical"):
                if not isinstance(value, bool):
                    raise InputError(f"cost parameters: {name} must be true or false, got {value!r}")
                values[name] = value
            else:
                values[name] = _number(name, value)
        return cls(**values)


# fields a cost-params file cannot set: measured profiles, and what a run recorded (runs/, launch defaults)
NOT_IN_FILES = ("layer_profiles", "runtime", "compute_dtype", "loss_chunk_tokens")

# The physical limit of each number a cost-parameter file may set (physical_limits.py gives each bound's reason).
LIMITS: dict[str, Limit] = {
    **dict.fromkeys(("default_compute_efficiency", "measured_compute_efficiency", "tf32_compute_efficiency",
                     "cpu_attention_efficiency", "tp_comm_efficiency", "p2p_efficiency", "dp_comm_efficiency",
                     "memory_bandwidth_efficiency", "compute_efficiency"), EFFICIENCY),
    **dict.fromkeys(("default_compute_intercept", "compute_intercept"), INTERCEPT),
    **dict.fromkeys(("dp_overlap_fraction", "memory_fragmentation", "memory_safety_margin"), SHARE),
    **dict.fromkeys(("host_op_seconds", "cpu_op_seconds", "kernel_seconds"), OP_SECONDS),
    **dict.fromkeys(("grad_reduce_bytes", "activation_transfer_bytes", "eager_score_bytes"), BYTES_PER_ELEMENT),
    **dict.fromkeys(("optimizer_bytes_per_param", "optimizer_state_bytes"), BYTES_PER_PARAMETER),
    **dict.fromkeys(("loss_passes", "activation_bytes_factor", "dp_buffer_factor", "nccl_channels_nvlink",
                     "nccl_channels_other"), FACTOR),
    **dict.fromkeys(("memory_reserve_bytes", "cpu_memory_reserve_bytes", "nccl_channel_bytes"), HELD_BYTES),
}
# A number this module does not name yet: finite and not negative, at most a factor of 1e15 (no parameter is a
# count or size beyond that: the largest, memory_reserve_bytes, is limited to 1 PiB).
_ANY_NUMBER = Limit("", 0.0, 1e15)


def _number(name: str, value: Any) -> float:
    """`value` within the limit of parameter `name` (`name` may carry a table key: "compute_efficiency[A100]")."""
    limit = LIMITS.get(name.partition("[")[0], _ANY_NUMBER)
    return float(limit.check(value, f"cost parameters: {name}"))


def _efficiency_overrides(value: Any, name: str = "compute_efficiency") -> dict[str, float]:
    """Validate {"TYPE[:dtype]": number} (each within the limit of `name`); catalog names and aliases are
    canonicalised."""
    if not isinstance(value, Mapping):
        raise InputError(f"cost parameters: {name} must be an object of device type -> number")
    out: dict[str, float] = {}
    for key, fraction in value.items():
        type_name, _, dtype = str(key).partition(":")
        if dtype and dtype not in ("fp16", "fp32", "bf16", "tf32"):
            raise InputError(f"cost parameters: {name} key {key!r}: dtype must be fp16, bf16, fp32 or tf32")
        if type_name.lower() in {n.lower() for n in CATALOG} or _is_alias(type_name):
            type_name = canonical_name(type_name)
        number = _number(f"{name}[{key}]", fraction)
        # A key without a dtype sets every dtype class (a table entry always names one).
        for cls_name in ((dtype_class(dtype),) if dtype else ("fp16", "fp32", "tf32")):
            out[f"{type_name}:{cls_name}"] = number
    return out


def _is_alias(name: str) -> bool:
    try:
        canonical_name(name)
    except InputError:
        return False
    return True

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
from ..hardware.catalog import CATALOG, GIB, canonical_name
from .reference_efficiency import REFERENCE_EFFICIENCY


def _reference_table() -> dict[str, float]:
    return {key: eff for key, (eff, _n) in REFERENCE_EFFICIENCY.items()}


def _median_half_precision() -> float:
    return round(statistics.median(e for k, (e, _n) in REFERENCE_EFFICIENCY.items() if k.endswith(":fp16")), 3)


def dtype_class(dtype: str) -> str:
    """The efficiency table's dtype key: "fp32" for fp32, "fp16" for both 16-bit formats."""
    return "fp32" if dtype == "fp32" else "fp16"


@dataclass(frozen=True)
class CostParams:
    """Every efficiency factor and overhead of the cost model, named, with defaults and their source.

    compute_efficiency: "DEVICE-TYPE" or "DEVICE-TYPE:fp16|fp32" -> fraction of the dense catalog peak a
        Llama layer achieves (forward + backward). Default: scripts/derive_efficiency.py from the Cephalo
        measurements; bf16 uses the fp16 figure.
    default_compute_efficiency: for types absent from the table: the median of the table's fp16 entries.
    measured_compute_efficiency: for devices whose peak was measured by `flashflex profile` (a matmul
        rate, not a datasheet peak): the fraction of that rate a whole layer achieves. 0.8:
        scripts/measure_cpu_efficiency.py measured 0.73-0.91 (median 0.81) on a one-thread CPU device.
    tp_comm_efficiency, p2p_efficiency, dp_comm_efficiency: achieved fraction of a link's bandwidth for
        TP all-reduces, pipeline sends and DP gradient all-reduces. 1.0: link classes already hold
        achieved rates (hardware/links.py).
    dp_overlap_fraction: fraction of a stage's DP reduction that may overlap its last backward pass.
        0.0: the runtime reduces gradients after the whole backward has finished.
    grad_reduce_bytes: bytes per gradient element in the DP all-reduce. 4: the runtime keeps fp32
        parameters and gradients and computes under autocast (runtime/engine.py), as Megatron reduces
        fp32 main gradients.
    activation_transfer_bytes: bytes per element of the activations and gradients sent between pipeline
        stages. 4: the runtime sends them in fp32 (runtime/pipeline.py).
    memory_bandwidth_efficiency: achieved fraction of datasheet memory bandwidth for streaming kernels
        (embedding, loss, optimizer step). 0.8: a typical figure for copy kernels on current GPUs (an
        assumption, not measured here; these terms are a few percent of an iteration).
    optimizer_bytes_per_param: bytes Adam moves per parameter in one step: reads fp32 master, m, v and
        a 16-bit gradient, writes master, m, v and the 16-bit weight (4+4+4+2 twice = 28).
    loss_passes: passes over the fp32 logits of one micro-batch in the loss (upcast, log-softmax,
        gradient: read and write), used for the memory-bound part of the head.
    master_weights: keep fp32 master weights when training in bf16/fp16 (mixed precision, 4 bytes/param).
    optimizer_state_bytes: Adam's m and v in fp32 (8 bytes/param).
    activation_bytes_factor: multiplier on the counted saved tensors (1.0 = exactly the tensors listed in
        model/flops.py; raise it to cover framework temporaries).
    memory_reserve_bytes: per GPU, held outside PyTorch's tensors: CUDA context, cuBLAS workspace,
        NCCL buffers. 1 GiB: an assumed round figure, not measured here; override it from a profile.
    cpu_memory_reserve_bytes: the same for an emulated CPU device (process and gloo buffers); assumed.
    memory_fragmentation: fraction of device memory the caching allocator cannot hand out; 0.05 assumed.
    """

    compute_efficiency: Mapping[str, float] = field(default_factory=_reference_table)
    default_compute_efficiency: float = field(default_factory=_median_half_precision)
    measured_compute_efficiency: float = 0.8
    tp_comm_efficiency: float = 1.0
    p2p_efficiency: float = 1.0
    dp_comm_efficiency: float = 1.0
    dp_overlap_fraction: float = 0.0
    grad_reduce_bytes: float = 4.0
    activation_transfer_bytes: float = 4.0
    memory_bandwidth_efficiency: float = 0.8
    optimizer_bytes_per_param: float = 28.0
    loss_passes: float = 4.0
    master_weights: bool = True
    optimizer_state_bytes: float = 8.0
    activation_bytes_factor: float = 1.0
    memory_reserve_bytes: float = 1.0 * GIB
    cpu_memory_reserve_bytes: float = 0.25 * GIB
    memory_fragmentation: float = 0.05

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:  # computed once: params are hashed in every cache lookup of the hot path
            values = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "compute_efficiency"]
            cached = hash((tuple(sorted(self.compute_efficiency.items())), *values))
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
        return self.default_compute_efficiency

    @classmethod
    def from_overrides(cls, overrides: Mapping[str, Any]) -> CostParams:
        """Defaults with `overrides` applied; an unknown name or a bad value raises InputError."""
        if not isinstance(overrides, Mapping):
            raise InputError("cost parameters: expected a JSON object of name -> value")
        names = {f.name: f for f in dataclasses.fields(cls)}
        base = cls()
        values: dict[str, Any] = {}
        for name, value in overrides.items():
            if name not in names:
                raise InputError(f"cost parameters: unknown name {name!r}; known: {', '.join(sorted(names))}")
            if name == "compute_efficiency":
                values[name] = {**base.compute_efficiency, **_efficiency_overrides(value)}
            elif name == "master_weights":
                if not isinstance(value, bool):
                    raise InputError(f"cost parameters: {name} must be true or false, got {value!r}")
                values[name] = value
            else:
                values[name] = _number(name, value)
        return cls(**values)


_FRACTIONS = {"default_compute_efficiency", "measured_compute_efficiency", "tp_comm_efficiency",
              "p2p_efficiency", "dp_comm_efficiency", "memory_bandwidth_efficiency"}


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"cost parameters: {name} must be a number, got {value!r}")
    value = float(value)
    if name in _FRACTIONS and not 0.0 < value <= 1.0:
        raise InputError(f"cost parameters: {name} must be in (0, 1], got {value}")
    if name in ("dp_overlap_fraction", "memory_fragmentation") and not 0.0 <= value < 1.0:
        raise InputError(f"cost parameters: {name} must be in [0, 1), got {value}")
    if value < 0:
        raise InputError(f"cost parameters: {name} must not be negative, got {value}")
    return value


def _efficiency_overrides(value: Any) -> dict[str, float]:
    """Validate {"TYPE[:dtype]": fraction}; catalog names and aliases are canonicalised."""
    if not isinstance(value, Mapping):
        raise InputError("cost parameters: compute_efficiency must be an object of device type -> fraction")
    out: dict[str, float] = {}
    for key, fraction in value.items():
        type_name, _, dtype = str(key).partition(":")
        if dtype and dtype not in ("fp16", "fp32", "bf16"):
            raise InputError(f"cost parameters: compute_efficiency key {key!r}: dtype must be fp16 or fp32")
        if type_name.lower() in {name.lower() for name in CATALOG} or _is_alias(type_name):
            type_name = canonical_name(type_name)
        number = _number(f"compute_efficiency[{key}]", fraction)
        if not 0.0 < number <= 1.0:
            raise InputError(f"cost parameters: compute_efficiency[{key}] must be in (0, 1], got {number}")
        # A key without a dtype sets both dtype classes (a table entry always names one).
        for cls_name in ((dtype_class(dtype),) if dtype else ("fp16", "fp32")):
            out[f"{type_name}:{cls_name}"] = number
    return out


def _is_alias(name: str) -> bool:
    try:
        canonical_name(name)
    except InputError:
        return False
    return True

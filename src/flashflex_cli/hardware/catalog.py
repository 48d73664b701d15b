"""Device catalog: dense peak FLOP/s per dtype, memory and memory bandwidth of accelerator types.

All figures are vendor datasheet values, *dense* (never the 2:4-sparsity figure), in SI units:
FLOP/s, bytes, bytes/s. Tensor-core figures for GeForce cards are the FP32-accumulate rate, which is
what mixed-precision training uses. Sources are cited per entry in docs/devices.md.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from ..errors import InputError

GIB = 1024**3
TERA = 1e12


# What each generation computes natively (docs/devices.md cites the sources).
AMPERE_ON = ("fp32", "tf32", "fp16", "bf16")  # NVIDIA Ampere, Ada, Hopper, Blackwell: TF32/FP16/BF16 tensor cores
FP16_TENSOR_CORES = ("fp32", "fp16")  # Volta, Turing: FP16 tensor cores, no BF16 or TF32
# Pascal: no tensor cores. P100's 2x FP16 rate is packed half2 arithmetic accumulating in FP16; mixed precision
# accumulates in FP32, and measured FP16 layers on a P100 run at its FP32 speed (reference_efficiency.py).
FP32_ONLY = ("fp32",)
CDNA2 = ("fp32", "fp16", "bf16")  # AMD MI250X: FP16/BF16 matrix cores, no TF32
CPU = ("fp32", "bf16")  # the nominal emulated device: its own bf16 figure (a CPU without bf16 units is slower)


@dataclass(frozen=True)
class DeviceType:
    """One accelerator model.

    peak_flops: dense peak FLOP/s per dtype ("fp32", "tf32", "fp16", "bf16"); a dtype the device
    has no fast path for is absent. memory_bytes: usable device memory (bytes). memory_bandwidth: bytes/s.
    native_dtypes: the dtypes it computes natively (tensor cores or an equivalent matrix unit; fp32 always):
    a dtype outside it runs at no more than the fp32 rate, whatever `peak_flops` says for it.
    """

    name: str
    vendor: str
    memory_bytes: int
    memory_bandwidth: float
    peak_flops: dict[str, float]
    aliases: tuple[str, ...] = field(default=())
    default_intra_link: str = "pcie"
    native_dtypes: tuple[str, ...] = AMPERE_ON


def _tf(**dtypes: float) -> dict[str, float]:
    """Peak figures given in TFLOP/s -> FLOP/s."""
    return {dtype: value * TERA for dtype, value in dtypes.items()}


_ENTRIES: tuple[DeviceType, ...] = (
    DeviceType("V100-16G", "nvidia", 16 * GIB, 900e9, _tf(fp32=15.7, fp16=125.0), ("v100", "v100-16g-sxm2"), "nvlink", native_dtypes=FP16_TENSOR_CORES),
    DeviceType("V100-32G", "nvidia", 32 * GIB, 900e9, _tf(fp32=15.7, fp16=125.0), ("v100-32g-sxm2", "v100_32g"), "nvlink", native_dtypes=FP16_TENSOR_CORES),
    DeviceType("P100", "nvidia", 16 * GIB, 732e9, _tf(fp32=9.3, fp16=18.7), ("p100-16g",), native_dtypes=FP32_ONLY),
    DeviceType("P40", "nvidia", 24 * GIB, 346e9, _tf(fp32=11.8), ("tesla-p40",), native_dtypes=FP32_ONLY),
    DeviceType("T4", "nvidia", 16 * GIB, 320e9, _tf(fp32=8.1, fp16=65.0), ("tesla-t4",), native_dtypes=FP16_TENSOR_CORES),
    DeviceType("A10", "nvidia", 24 * GIB, 600e9, _tf(fp32=31.2, tf32=62.5, fp16=125.0, bf16=125.0)),
    DeviceType("A10G", "nvidia", 24 * GIB, 600e9, _tf(fp32=31.2, tf32=35.0, fp16=70.0, bf16=70.0)),
    DeviceType("A30", "nvidia", 24 * GIB, 933e9, _tf(fp32=10.3, tf32=82.0, fp16=165.0, bf16=165.0)),
    DeviceType("A40", "nvidia", 48 * GIB, 696e9, _tf(fp32=37.4, tf32=74.8, fp16=149.7, bf16=149.7)),
    DeviceType("RTX-A6000", "nvidia", 48 * GIB, 768e9, _tf(fp32=38.7, tf32=77.4, fp16=154.8, bf16=154.8), ("a6000", "rtxa6000")),
    DeviceType("RTX-3080Ti", "nvidia", 12 * GIB, 912e9, _tf(fp32=34.1, tf32=34.1, fp16=68.2, bf16=68.2), ("3080ti", "rtx3080ti")),
    DeviceType("RTX-3090", "nvidia", 24 * GIB, 936e9, _tf(fp32=35.6, tf32=35.6, fp16=71.0, bf16=71.0), ("3090", "rtx3090")),
    DeviceType("RTX-4090", "nvidia", 24 * GIB, 1008e9, _tf(fp32=82.6, tf32=82.6, fp16=165.2, bf16=165.2), ("4090", "rtx4090")),
    DeviceType("L4", "nvidia", 24 * GIB, 300e9, _tf(fp32=30.3, tf32=60.0, fp16=121.0, bf16=121.0)),
    DeviceType("L40", "nvidia", 48 * GIB, 864e9, _tf(fp32=90.5, tf32=90.5, fp16=181.0, bf16=181.0)),
    DeviceType("L40S", "nvidia", 48 * GIB, 864e9, _tf(fp32=91.6, tf32=183.0, fp16=362.05, bf16=362.05)),
    DeviceType("A100-40G-PCIe", "nvidia", 40 * GIB, 1555e9, _tf(fp32=19.5, tf32=156.0, fp16=312.0, bf16=312.0), ("a100-pcie-40g",)),
    DeviceType("A100-80G-PCIe", "nvidia", 80 * GIB, 1935e9, _tf(fp32=19.5, tf32=156.0, fp16=312.0, bf16=312.0), ("a100-pcie", "a100-pcie-80g")),
    DeviceType("A100-40G-SXM", "nvidia", 40 * GIB, 1555e9, _tf(fp32=19.5, tf32=156.0, fp16=312.0, bf16=312.0), ("a100-40g", "a100-sxm4-40g"), "nvlink"),
    DeviceType("A100-80G-SXM", "nvidia", 80 * GIB, 2039e9, _tf(fp32=19.5, tf32=156.0, fp16=312.0, bf16=312.0), ("a100", "a100-80g", "a100-sxm4-80g"), "nvlink"),
    DeviceType("H100-PCIe", "nvidia", 80 * GIB, 2.0e12, _tf(fp32=51.2, tf32=378.0, fp16=756.0, bf16=756.0)),
    DeviceType("H100-NVL", "nvidia", 94 * GIB, 3.9e12, _tf(fp32=60.0, tf32=417.5, fp16=835.0, bf16=835.0), ("h100nvl",)),
    DeviceType("H100-SXM", "nvidia", 80 * GIB, 3.35e12, _tf(fp32=67.0, tf32=494.7, fp16=989.4, bf16=989.4), ("h100", "h100-80g"), "nvlink"),
    DeviceType("H200", "nvidia", 141 * 10**9, 4.8e12, _tf(fp32=67.0, tf32=494.7, fp16=989.4, bf16=989.4), ("h200-sxm",), "nvlink"),
    DeviceType("B200", "nvidia", 180 * 10**9, 7.7e12, _tf(fp32=75.0, tf32=1100.0, fp16=2250.0, bf16=2250.0), ("b200-sxm",), "nvlink"),
    DeviceType("MI250X", "amd", 128 * GIB, 3.2768e12, _tf(fp32=95.7, fp16=383.0, bf16=383.0), ("instinct-mi250x",), "xgmi", native_dtypes=CDNA2),
    DeviceType("MI300X", "amd", 192 * GIB, 5.3e12, _tf(fp32=163.4, tf32=653.7, fp16=1307.4, bf16=1307.4), ("instinct-mi300x",), "xgmi"),
    # A nominal CPU "device" for emulated clusters; `flashflex profile` replaces these with measurements.
    DeviceType("cpu", "generic", 4 * GIB, 20e9, _tf(fp32=0.1, bf16=0.05), ("host",), "shm", native_dtypes=CPU),
)

CATALOG: dict[str, DeviceType] = {entry.name: entry for entry in _ENTRIES}
_LOOKUP: dict[str, str] = {}
for _entry in _ENTRIES:
    for _key in (_entry.name, *_entry.aliases):
        _LOOKUP[_key.lower()] = _entry.name


def device_type(name: str) -> DeviceType:
    """Look a device type up by name or alias (case-insensitive); unknown names suggest the closest ones."""
    key = name.strip().lower()
    if key in _LOOKUP:
        return CATALOG[_LOOKUP[key]]
    close = difflib.get_close_matches(key, list(_LOOKUP), n=3, cutoff=0.4)
    names = sorted({_LOOKUP[c] for c in close})
    hint = f"; did you mean {', '.join(names)}?" if names else f"; known types: {', '.join(CATALOG)}"
    raise InputError(f"unknown device type {name!r}{hint}")


def canonical_name(name: str) -> str:
    """The catalog's own name for a device type or alias."""
    return device_type(name).name

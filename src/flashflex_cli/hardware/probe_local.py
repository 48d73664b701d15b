"""Measure this machine: matmul FLOP/s, memory capacity, memory bandwidth, device-to-device copies.

GPU (CUDA): bf16 n x n matmuls, `torch.cuda.mem_get_info`, copies between every device pair, and the dtypes
it computes natively from its compute capability (`native_dtypes_for_capability`).
CPU-only: fp32 matmuls and copies with one thread pinned to one core, as the runtime runs each emulated
device (hardware/cpu_share.py), so the measured peak is a one-core figure; host memory from /proc/meminfo
shared by `cpu_devices` emulated devices and, with 2 or more of them, the "shm" link between them measured the
way the runtime uses it: two spawned processes exchanging tensors with gloo over loopback TCP
(probe_gloo.py; bandwidth and one-way latency). One emulated device has no such link.
Every figure is the best of a few timed runs (the least disturbed by other load).
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..hostnames import host_problem
from .catalog import AMPERE_ON, FP16_TENSOR_CORES, FP32_ONLY, device_type
from .cluster import Device, DevicePair, IntraLink, Node
from .cpu_share import as_emulated_device
from .device_sync import synchronize
from .gpu_identity import visible_gpus
from .probe_gloo import FULL_GLOO, QUICK_GLOO, GlooProbe, gloo_link

MIB = 1024**2


@dataclass(frozen=True)
class ProbeSizes:
    """Sizes of the timed runs: matmul edge n (elements), copy size (bytes), timed repeats."""

    matmul_n: int
    copy_bytes: int
    repeats: int


QUICK_CPU = ProbeSizes(matmul_n=256, copy_bytes=16 * MIB, repeats=3)
FULL_CPU = ProbeSizes(matmul_n=1024, copy_bytes=256 * MIB, repeats=5)
QUICK_GPU = ProbeSizes(matmul_n=2048, copy_bytes=64 * MIB, repeats=3)
FULL_GPU = ProbeSizes(matmul_n=8192, copy_bytes=1024 * MIB, repeats=10)


@dataclass(frozen=True)
class DeviceProbe:
    """One measured device: matmul FLOP/s in `dtype`, memory (bytes), memory bandwidth (bytes/s), the dtypes it
    computes natively where the probe can tell (None: the catalog's for its type), and a GPU's UUID and PCI bus
    id where torch exposes them (hardware/gpu_identity.py; the runtime finds the device by them)."""

    index: int
    name: str
    dtype: str
    matmul_flops: float
    memory_bytes: int
    memory_bandwidth: float
    native_dtypes: tuple[str, ...] | None = None
    uuid: str | None = None
    bus_id: str | None = None


def native_dtypes_for_capability(major: int, minor: int) -> tuple[str, ...]:
    """Dtypes an NVIDIA GPU of compute capability `major.minor` computes natively (tensor cores): TF32, FP16
    and BF16 from Ampere (8.x) on, FP16 on Volta and Turing (7.x), FP32 only before (Pascal, 6.x)."""
    if major >= 8:
        return AMPERE_ON
    if major == 7:
        return FP16_TENSOR_CORES
    return FP32_ONLY


def gpu_native_dtypes(index: int) -> tuple[str, ...] | None:
    """`native_dtypes_for_capability` of CUDA device `index`; None on ROCm (its capability numbers are AMD
    architecture numbers: the catalog's list for the matched type applies)."""
    if torch.version.hip is not None:
        return None
    return native_dtypes_for_capability(*torch.cuda.get_device_capability(index))


@dataclass(frozen=True)
class CopyProbe:
    """Device-to-device copy bandwidth (bytes/s, one direction) between local devices a and b."""

    a: int
    b: int
    bandwidth: float


@dataclass(frozen=True)
class NodeProbe:
    """Everything measured on one host. gloo: the loopback gloo link between emulated CPU devices (2+)."""

    hostname: str
    kind: str  # "cuda" or "cpu"
    devices: list[DeviceProbe]
    copies: list[CopyProbe] = field(default_factory=list)
    gloo: GlooProbe | None = None


def _best_time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Shortest wall time (seconds) of `repeats` runs of `fn` after one warm-up run."""
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    """Achieved FLOP/s of an (n x n) @ (n x n) matmul (2 n^3 FLOP), best of `repeats`."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _best_time(lambda: torch.mm(a, b, out=out), device, repeats)
    return 2.0 * n**3 / seconds


def memory_bandwidth(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes/s of a same-device tensor copy, counting bytes read plus bytes written (2 x nbytes)."""
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), device, repeats)
    return 2.0 * src.numel() * 4 / seconds


def copy_bandwidth(src_device: torch.device, dst_device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes/s of copying an nbytes tensor from one device to another (one direction)."""
    src = torch.ones(nbytes // 4, device=src_device, dtype=torch.float32)
    dst = torch.empty(src.numel(), device=dst_device, dtype=torch.float32)

    def copy() -> None:
        dst.copy_(src, non_blocking=False)
        synchronize(src_device)

    seconds = _best_time(copy, dst_device, repeats)
    return src.numel() * 4 / seconds


def host_memory_bytes() -> int:
    """Total host memory in bytes (/proc/meminfo MemTotal, else sysconf)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def gpu_memory_bytes(index: int) -> int:
    """Total memory of CUDA device `index` in bytes (mem_get_info, else device properties)."""
    try:
        _free, total = torch.cuda.mem_get_info(index)
        return int(total)
    except RuntimeError:
        return int(torch.cuda.get_device_properties(index).total_memory)


_GPU_RULES: tuple[tuple[str, str], ...] = (
    ("mi300x", "MI300X"), ("mi250x", "MI250X"), ("b200", "B200"), ("h200", "H200"),
    ("h100 nvl", "H100-NVL"), ("h100 pcie", "H100-PCIe"), ("h100", "H100-SXM"),
    ("a100", "A100"), ("l40s", "L40S"), ("l40", "L40"), ("l4", "L4"),
    ("a10g", "A10G"), ("a10", "A10"), ("a30", "A30"), ("a40", "A40"), ("a6000", "RTX-A6000"),
    ("3080 ti", "RTX-3080Ti"), ("3090", "RTX-3090"), ("4090", "RTX-4090"), ("t4", "T4"),
    ("v100", "V100"), ("p100", "P100"), ("p40", "P40"),
)


def catalog_match(gpu_name: str, memory_bytes: int) -> str | None:
    """The catalog type of a GPU reported as `gpu_name` (torch.cuda.get_device_name), or None."""
    name = gpu_name.lower().replace("_", " ")
    big = memory_bytes > 48 * 1024**3
    for needle, result in _GPU_RULES:
        if not re.search(rf"(?<![a-z0-9]){re.escape(needle)}(?![0-9])", name):
            continue
        if result == "A100":
            size = "80G" if big else "40G"
            return f"A100-{size}-PCIe" if "pcie" in name else f"A100-{size}-SXM"
        if result == "V100":
            return "V100-32G" if memory_bytes > 20 * 1024**3 else "V100-16G"
        return device_type(result).name
    return None


def _progress(enabled: bool, total: int, label: str):  # noqa: ANN202 - a rich Progress or a stub
    """A rich progress bar on stderr (or a no-op) with one task of `total` steps."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled)
    task = progress.add_task(label, total=total)
    return progress, task


def probe_node(quick: bool = False, cpu_devices: int = 1, progress: bool = True) -> NodeProbe:
    """Measure every local device (CUDA if present, else `cpu_devices` emulated CPU devices)."""
    hostname = socket.gethostname()
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return _probe_cuda(hostname, QUICK_GPU if quick else FULL_GPU, progress)
    return _probe_cpu(hostname, cpu_devices, QUICK_CPU if quick else FULL_CPU, progress, quick)


def _probe_cuda(hostname: str, sizes: ProbeSizes, show: bool) -> NodeProbe:
    count = torch.cuda.device_count()
    pairs = [(a, b) for a in range(count) for b in range(count) if a < b]
    bar, task = _progress(show, 3 * count + len(pairs), f"probing {count} GPUs")
    devices: list[DeviceProbe] = []
    copies: list[CopyProbe] = []
    identity = visible_gpus()
    with bar:
        for i in range(count):
            dev = torch.device("cuda", i)
            flops = matmul_flops(dev, torch.bfloat16, sizes.matmul_n, sizes.repeats)
            bar.advance(task)
            memory = gpu_memory_bytes(i)
            bar.advance(task)
            bandwidth = memory_bandwidth(dev, sizes.copy_bytes, sizes.repeats)
            bar.advance(task)
            devices.append(DeviceProbe(i, torch.cuda.get_device_name(i), "bf16", flops, memory, bandwidth,
                                       gpu_native_dtypes(i), identity[i].uuid, identity[i].bus_id))
        for a, b in pairs:
            rate = copy_bandwidth(torch.device("cuda", a), torch.device("cuda", b), sizes.copy_bytes, sizes.repeats)
            copies.append(CopyProbe(a, b, rate))
            bar.advance(task)
    return NodeProbe(hostname, "cuda", devices, copies)


def _probe_cpu(hostname: str, cpu_devices: int, sizes: ProbeSizes, show: bool, quick: bool) -> NodeProbe:
    cpu = torch.device("cpu")
    linked = cpu_devices >= 2
    bar, task = _progress(show, 3 if linked else 2, f"probing host as {cpu_devices} cpu device(s)")
    gloo: GlooProbe | None = None
    with bar:
        with as_emulated_device(0):  # every emulated device runs on one core like this one
            flops = matmul_flops(cpu, torch.float32, sizes.matmul_n, sizes.repeats)
            bar.advance(task)
            bandwidth = memory_bandwidth(cpu, sizes.copy_bytes, sizes.repeats)
            bar.advance(task)
        if linked:
            bar.update(task, description="probing gloo loopback link between cpu devices")
            gloo = gloo_link(QUICK_GLOO if quick else FULL_GLOO)
            bar.advance(task)
    memory = host_memory_bytes() // cpu_devices
    devices = [DeviceProbe(i, "cpu", "fp32", flops, memory, bandwidth) for i in range(cpu_devices)]
    return NodeProbe(hostname, "cpu", devices, [], gloo)


def default_node_name(hostname: str) -> str:
    """A node name allowed by the cluster schema, derived from a hostname."""
    cleaned = re.sub(r"[^A-Za-z0-9_.\-]", "-", hostname.split(".")[0]).strip("-")
    return cleaned or "node"


def sig(value: float, digits: int = 4) -> float:
    """`value` rounded to `digits` significant digits (measurements are not more precise; files diff cleanly)."""
    return float(f"{value:.{digits}g}")


def _measured_device(probe: DeviceProbe, kind: str) -> Device:
    achieved = {probe.dtype: sig(probe.matmul_flops)}
    if kind == "cpu":
        return Device(type="cpu", memory_bytes=probe.memory_bytes, peak_flops=achieved,
                      memory_bandwidth=sig(probe.memory_bandwidth), source="measured", achieved_flops=achieved)
    match = catalog_match(probe.name, probe.memory_bytes)
    peak = dict(device_type(match).peak_flops) if match else achieved
    type_name = match or default_node_name(probe.name)
    return Device(type=type_name, memory_bytes=probe.memory_bytes, peak_flops=peak,
                  memory_bandwidth=sig(probe.memory_bandwidth), source="measured", achieved_flops=achieved,
                  native_dtypes=probe.native_dtypes, uuid=probe.uuid, pci_bus_id=probe.bus_id)


def node_from_probe(probe: NodeProbe, node_name: str | None = None, nic: str = "eth") -> Node:
    """Turn a NodeProbe into a cluster Node (measured devices, measured intra-node pairs)."""
    devices = [_measured_device(d, probe.kind) for d in probe.devices]
    if probe.kind == "cpu":
        gloo = probe.gloo
        intra = IntraLink(kind="shm", bandwidth=sig(gloo.bandwidth) if gloo else None,
                          latency_s=sig(gloo.latency_s) if gloo else None)
        pairs: list[DevicePair] = []
    else:
        slowest = min((c.bandwidth for c in probe.copies), default=None)
        kind = "nvlink" if slowest is not None and slowest > 40e9 else "pcie"
        intra = IntraLink(kind=kind, bandwidth=sig(slowest) if slowest else None)
        pairs = [DevicePair(a=c.a, b=c.b, bandwidth=sig(c.bandwidth)) for c in probe.copies]
    # a hostname no launch script could address (the schema refuses it) is left out: the node name stands in
    hostname = probe.hostname if host_problem(probe.hostname, underscores=True) is None else None
    return Node(name=node_name or default_node_name(probe.hostname), nic=nic,  # type: ignore[arg-type]
                hostname=hostname, devices=devices, intra_link=intra, intra_pairs=pairs)


def emulated(node: Node, slowdown: float) -> Node:
    """`node` with its CPU devices emulating devices `slowdown` times slower (the runtime stretches their
    compute by the factor); a GPU node is returned as it is (the factor is for emulation only)."""
    if slowdown == 1.0 or any(d.type != "cpu" for d in node.devices):
        return node
    return node.model_copy(update={"devices": [d.model_copy(update={"slowdown": slowdown}) for d in node.devices]})


def check_node_options(nic: str, node_name: str | None, cpu_devices: int = 1, slowdown: float = 1.0) -> None:
    """Validate probe options before any measurement (InputError, one line)."""
    from ..errors import InputError
    from .synthetic import NICS

    if nic not in NICS:
        raise InputError(f"--nic must be one of {', '.join(NICS)}, got {nic!r}")
    if node_name is not None and not re.match(r"^[A-Za-z0-9_.\-]+$", node_name):
        raise InputError(f"--node-name {node_name!r} may use only letters, digits and '_.-'")
    if cpu_devices < 1:
        raise InputError(f"--cpu-devices must be at least 1, got {cpu_devices}")
    if not (math.isfinite(slowdown) and 1.0 <= slowdown <= 1000.0):
        raise InputError(f"--slowdown must be a number from 1 to 1000, got {slowdown}")


def profile_node(quick: bool = False, cpu_devices: int = 1, node_name: str | None = None, nic: str = "eth",
                 progress: bool = True, slowdown: float = 1.0) -> Node:
    """Probe this machine and describe it as one cluster Node; `slowdown` > 1 makes its CPU devices emulate
    slower devices (see `emulated`)."""
    check_node_options(nic, node_name, cpu_devices, slowdown)
    return emulated(node_from_probe(probe_node(quick, cpu_devices, progress), node_name, nic), slowdown)

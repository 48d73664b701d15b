"""Cluster schema ("flashflex.cluster/1"): nodes, devices, links; validated on load.

Devices are addressed as "NODE/INDEX" (e.g. "node0/3"). `Cluster.link(a, b)` answers the bandwidth
and latency between any two devices: per-pair measurements where present, else link and NIC classes.
"""

from __future__ import annotations

import hashlib
import math
import os
from functools import cached_property, lru_cache
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeInt, model_validator
from pydantic_core import PydanticCustomError

from ..errors import InputError
from ..fileio import dumps_json, load_model, write_model
from ..hostnames import host_problem
from ..physical_limits import (
    DEVICE_FLOPS,
    DEVICE_MEMORY_BYTES,
    LATENCY_S,
    LINK_BANDWIDTH,
    MEMORY_BANDWIDTH,
    SLOWDOWN,
    limited,
)
from .catalog import device_type
from .links import INTRA_LINKS, NIC_LINKS, SAME_DEVICE, IntraKind, Link, NicKind

CLUSTER_SCHEMA = "flashflex.cluster/1"
ComputeDtype = Literal["fp32", "tf32", "fp16", "bf16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Every number of a cluster file within its physical limit (physical_limits.py gives each bound's reason).
MemoryBytes = limited(DEVICE_MEMORY_BYTES)
MemoryBandwidth = limited(MEMORY_BANDWIDTH)
Flops = limited(DEVICE_FLOPS)
Slowdown = limited(SLOWDOWN)
LinkBandwidth = limited(LINK_BANDWIDTH)
Latency = limited(LATENCY_S)
DeviceIndex = Annotated[NonNegativeInt, Field(strict=True)]
TypeName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00-\x1f\x7f]+$")]
GpuUuid = Annotated[str, Field(pattern=r"^([Gg][Pp][Uu]-)?[0-9A-Fa-f]{8}(-?[0-9A-Fa-f]{4}){3}-?[0-9A-Fa-f]{12}$")]
PciBusId = Annotated[str, Field(pattern=r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(\.[0-7])?$")]


def _host_name(text: str) -> str:
    problem = host_problem(text, underscores=True)
    if problem is not None:
        raise PydanticCustomError("host_name", f"{text[:60]!r} {problem}")
    return text


HostName = Annotated[str, AfterValidator(_host_name)]  # launch scripts address the node by it


class Device(_Strict):
    """One accelerator. peak_flops: dense FLOP/s per dtype; achieved_flops: measured matmul FLOP/s.

    native_dtypes: the dtypes it computes natively (tensor cores or an equivalent); absent: the catalog's for
    its type (`native`). A measured device keeps what its probe found.

    uuid, pci_bus_id: the GPU's identity as `flashflex profile` read it (hardware/gpu_identity.py); the runtime
    finds the device by them, whatever CUDA ordinal it has in the run. Absent (older files, synthetic clusters,
    CPU devices): by its index on the node.
    """

    type: TypeName
    memory_bytes: MemoryBytes
    peak_flops: dict[str, Flops]
    memory_bandwidth: MemoryBandwidth
    source: Literal["catalog", "measured", "cluster file"] = "catalog"
    achieved_flops: dict[str, Flops] | None = None
    slowdown: Slowdown = 1.0  # emulated devices compute this many times slower; the runtime honours it
    native_dtypes: tuple[ComputeDtype, ...] | None = None
    uuid: GpuUuid | None = None
    pci_bus_id: PciBusId | None = None

    @model_validator(mode="before")
    @classmethod
    def _numbers_of_an_uncatalogued_type(cls, data: Any) -> Any:
        """A type the catalog does not know has no figures but the file's: the file must give them all (its peak
        FLOP/s in at least one dtype, its memory and memory bandwidth). A measured device has its probe's
        figures. A dtype without a peak figure is costed at the fp32 rate, refused where that is missing too."""
        if not isinstance(data, dict) or not isinstance(data.get("type"), str) or data.get("source") == "measured":
            return data
        if _catalog_native(data["type"]) is not None:
            return data
        peaks = data.get("peak_flops")
        missing = [name for name, given in (("peak_flops (FLOP/s)", isinstance(peaks, dict) and bool(peaks)),
                                            ("memory_bytes", "memory_bytes" in data),
                                            ("memory_bandwidth (B/s)", "memory_bandwidth" in data)) if not given]
        if missing:
            raise ValueError(f"device type {data['type'][:60]!r} is not in the catalog, so the cluster file must "
                             f"give its figures; it lacks {', '.join(missing)}")
        return data

    @property
    def numbers_source(self) -> str:
        """Where this device's peak FLOP/s, memory and bandwidth come from: "measured" (its probe), "catalog"
        (its type's datasheet entry), or "cluster file" (a type the catalog does not know: the file's own)."""
        if self.source == "measured":
            return "measured"
        return "catalog" if _catalog_native(self.type) is not None else "cluster file"

    def native(self) -> frozenset[str]:
        """The dtypes this device computes natively: its own `native_dtypes`, else the catalog's for its type,
        else (a type the catalog does not know) the dtypes its `peak_flops` names; fp32 always."""
        if self.native_dtypes is not None:
            return frozenset(("fp32", *self.native_dtypes))
        return _catalog_native(self.type) or frozenset(("fp32", *self.peak_flops))

    def compute_dtype(self, dtype: str) -> str:
        """The dtype whose rate `dtype` runs at here: `dtype` itself when native, else fp32 (a matmul in a
        dtype the device lacks is converted and computed by its fp32 units, at no more than their rate)."""
        return dtype if dtype in self.native() else "fp32"

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s of a matmul in `dtype` on this device, divided by the emulation slowdown.

        A native dtype: its dense peak, falling back bf16 -> fp16 -> fp32 where the file gives no figure for
        it. A dtype the device lacks: at most the fp32 peak (`compute_dtype`).
        """
        if self.compute_dtype(dtype) == dtype:
            for candidate in (dtype, "fp16" if dtype == "bf16" else dtype, "fp32"):
                if candidate in self.peak_flops:
                    return self.peak_flops[candidate] / self.slowdown
            raise InputError(f"device type {self.type!r} has no peak FLOP/s for {dtype!r}")
        if "fp32" not in self.peak_flops:
            raise InputError(f"device type {self.type!r} lacks {dtype!r} (it runs at no more than the fp32 rate) "
                             "and its peak_flops give no fp32 figure")
        return min(self.peak_flops.get(dtype, math.inf), self.peak_flops["fp32"]) / self.slowdown


@lru_cache(maxsize=256)
def _catalog_native(type_name: str) -> frozenset[str] | None:
    """The catalog's native dtypes of `type_name` (None for a type it does not know)."""
    try:
        return frozenset(("fp32", *device_type(type_name).native_dtypes))
    except InputError:
        return None


class IntraLink(_Strict):
    """The fabric inside one node: kind and bandwidth (bytes/s per direction)."""

    kind: IntraKind
    bandwidth: LinkBandwidth | None = None
    latency_s: Latency | None = None


class DevicePair(_Strict):
    """A measured link between two devices of one node, by local index."""

    a: DeviceIndex
    b: DeviceIndex
    bandwidth: LinkBandwidth
    latency_s: Latency | None = None


class Node(_Strict):
    """One host: its NIC class, its devices and its intra-node fabric."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    nic: NicKind = "eth"
    nic_bandwidth: LinkBandwidth | None = None  # bytes/s; overrides the NIC class default
    hostname: HostName | None = None
    devices: list[Device] = Field(min_length=1)
    intra_link: IntraLink = IntraLink(kind="pcie")
    intra_pairs: list[DevicePair] = []

    @model_validator(mode="after")
    def _pairs_in_range(self) -> Node:
        for pair in self.intra_pairs:
            for index in (pair.a, pair.b):
                if not 0 <= index < len(self.devices):
                    raise ValueError(f"intra_pairs names device {index}, node {self.name} has {len(self.devices)}")
        return self


class NodePair(_Strict):
    """A measured (or configured) link between two nodes: bandwidth in bytes/s."""

    a: str
    b: str
    bandwidth: LinkBandwidth
    latency_s: Latency | None = None


class InterNode(_Strict):
    """Links between nodes: per-pair measurements, else `default_bandwidth`, else the NIC classes."""

    default_bandwidth: LinkBandwidth | None = None
    latency_s: Latency | None = None
    pairs: list[NodePair] = []


class Cluster(_Strict):
    """A heterogeneous cluster: nodes of devices joined by links."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    schema_: Literal["flashflex.cluster/1"] = Field(CLUSTER_SCHEMA, alias="schema")
    name: str = "cluster"
    description: str | None = None
    nodes: list[Node] = Field(min_length=1)
    inter_node: InterNode = InterNode()

    @model_validator(mode="after")
    def _consistent(self) -> Cluster:
        names = [node.name for node in self.nodes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate node names: {', '.join(duplicates)}")
        for pair in self.inter_node.pairs:
            for end in (pair.a, pair.b):
                if end not in names:
                    raise ValueError(f"inter_node pair names unknown node {end!r}")
        return self

    # ---- addressing ---------------------------------------------------------------------------
    @cached_property
    def device_ids(self) -> list[str]:
        """Every device id "NODE/INDEX", nodes in file order, devices in index order."""
        return [f"{node.name}/{i}" for node in self.nodes for i in range(len(node.devices))]

    @cached_property
    def _node_index(self) -> dict[str, Node]:
        return {node.name: node for node in self.nodes}

    def split_id(self, device_id: str) -> tuple[Node, int]:
        """Resolve "NODE/INDEX" to (node, index); unknown ids raise InputError."""
        node_name, _, index_text = device_id.rpartition("/")
        node = self._node_index.get(node_name)
        if node is None or not index_text.isdigit() or int(index_text) >= len(node.devices):
            raise InputError(f"unknown device {device_id!r} in cluster {self.name!r}")
        return node, int(index_text)

    def device(self, device_id: str) -> Device:
        """The Device addressed by "NODE/INDEX"."""
        node, index = self.split_id(device_id)
        return node.devices[index]

    def node_of(self, device_id: str) -> str:
        """The node name of a device id."""
        return self.split_id(device_id)[0].name

    # ---- links --------------------------------------------------------------------------------
    def link(self, a: str, b: str) -> Link:
        """Bandwidth (bytes/s) and latency (s) between devices `a` and `b` ("NODE/INDEX")."""
        node_a, index_a = self.split_id(a)
        node_b, index_b = self.split_id(b)
        if node_a.name == node_b.name:
            if index_a == index_b:
                return SAME_DEVICE
            return self._intra(node_a, index_a, index_b)
        return self.node_link(node_a.name, node_b.name)

    def _intra(self, node: Node, i: int, j: int) -> Link:
        klass = INTRA_LINKS[node.intra_link.kind]
        latency = node.intra_link.latency_s or klass.latency_s
        for pair in node.intra_pairs:
            if {pair.a, pair.b} == {i, j}:
                return Link(pair.bandwidth, pair.latency_s or latency, node.intra_link.kind)
        return Link(node.intra_link.bandwidth or klass.bandwidth, latency, node.intra_link.kind)

    def node_link(self, a: str, b: str) -> Link:
        """The link between two different nodes.

        Order of precedence: a measured pair; `inter_node.default_bandwidth`; the NIC classes, where
        two unlike RDMA fabrics (InfiniBand and RoCE) cannot talk RDMA to each other and fall back to
        Ethernet (Holmes, arXiv 2312.03549), and otherwise the slower NIC sets the pace.
        """
        node_a, node_b = self._node_index[a], self._node_index[b]
        kind = node_a.nic if node_a.nic == node_b.nic else "eth"
        klass = NIC_LINKS[kind]
        latency = self.inter_node.latency_s or klass.latency_s
        for pair in self.inter_node.pairs:
            if {pair.a, pair.b} == {a, b}:
                return Link(pair.bandwidth, pair.latency_s or latency, "measured")
        if self.inter_node.default_bandwidth is not None:
            return Link(self.inter_node.default_bandwidth, latency, kind)
        if kind == "eth" and node_a.nic != node_b.nic:  # the Ethernet class, or slower where an end's own
            # Ethernet NIC is slower (an RDMA end's nic_bandwidth is its fabric's figure, not its Ethernet's)
            bandwidth = min([klass.bandwidth] + [node.nic_bandwidth for node in (node_a, node_b)
                                                 if node.nic == "eth" and node.nic_bandwidth])
        else:
            ends = [node.nic_bandwidth or NIC_LINKS[node.nic].bandwidth for node in (node_a, node_b)]
            bandwidth = min(ends)
        return Link(bandwidth, latency, kind)

    # ---- identity and I/O -----------------------------------------------------------------------
    def to_json(self) -> str:
        """Stable JSON text of this cluster."""
        return dumps_json(self.model_dump(mode="json", by_alias=True, exclude_none=True))

    def sha256(self) -> str:
        """Content hash of the canonical JSON; plans record it to detect a mismatched cluster."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """Load and validate a cluster file. A device type the catalog does not know is accepted: the file
    gives its peaks, and the cost model uses the default efficiency curve for it (and says so)."""
    return load_model(path, Cluster, CLUSTER_SCHEMA)


def file_figures_warnings(cluster: Cluster, path: str | os.PathLike[str]) -> list[str]:
    """One line per device type of `cluster` that the catalog does not know and no probe measured: its figures
    are the cluster file's alone, costed with the default efficiency curve."""
    kinds: dict[str, int] = {}
    for node in cluster.nodes:
        for device in node.devices:
            if device.numbers_source == "cluster file":
                kinds[device.type] = kinds.get(device.type, 0) + 1
    return [f"{path}: device type {name!r} ({count} device{'s' if count > 1 else ''}) is not in the catalog: its "
            "peak FLOP/s, memory and memory bandwidth are the cluster file's (source: cluster file), costed with "
            "the default efficiency curve (give a layer profile to measure them)" for name, count in kinds.items()]


def is_catalogued(type_name: str) -> bool:
    """True when the device catalog knows `type_name` (or an alias of it)."""
    try:
        device_type(type_name)
    except InputError:
        return False
    return True


def save_cluster(path: str | os.PathLike[str], cluster: Cluster) -> None:
    """Write a cluster file atomically, with stable key order."""
    from ..fileio import atomic_write_text

    atomic_write_text(path, cluster.to_json())


__all__ = ["CLUSTER_SCHEMA", "Cluster", "Device", "DevicePair", "InterNode", "IntraLink", "Node", "NodePair",
           "file_figures_warnings", "is_catalogued", "load_cluster", "save_cluster", "write_model"]

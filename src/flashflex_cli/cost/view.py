"""Per-cluster lookups the hot path needs, computed once per Cluster object.

Cluster is a frozen pydantic model but not hashable (it holds lists), so views are cached by object
identity in a small bounded table that keeps the cluster alive while its view is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..errors import InputError
from ..hardware.catalog import canonical_name
from ..hardware.cluster import Cluster, Device
from ..hardware.links import Link
from .params import CostParams

_MAX_VIEWS = 16


@dataclass(frozen=True)
class DeviceInfo:
    """What the cost model needs of one device: type, memory (bytes), bandwidth (bytes/s), node."""

    id: str
    node: str
    type: str
    measured: bool
    memory_bytes: float
    memory_bandwidth: float  # bytes/s, divided by the emulation slowdown
    is_cpu: bool


class ClusterView:
    """Cached device facts, links and compute rates of one Cluster."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._devices: dict[str, DeviceInfo] = {}
        self._node_of: dict[str, str] = {}
        self._objects: dict[str, Device] = {}
        self._links: dict[tuple[str, str], Link] = {}
        self._rates: dict[tuple[str, str, CostParams], float] = {}
        self._peaks: dict[tuple[str, str], float] = {}
        self.transfers: dict[tuple, float] = {}  # comm.transfer_time's memo
        types: dict[str, str] = {}
        for node in cluster.nodes:
            for index, dev in enumerate(node.devices):
                device_id = f"{node.name}/{index}"
                if dev.type not in types:
                    try:
                        types[dev.type] = canonical_name(dev.type)
                    except InputError:
                        types[dev.type] = dev.type
                type_name = types[dev.type]
                self._devices[device_id] = DeviceInfo(
                    device_id, node.name, type_name, dev.source == "measured" or bool(dev.achieved_flops),
                    float(dev.memory_bytes), dev.memory_bandwidth / dev.slowdown, type_name == "cpu")
                self._node_of[device_id] = node.name
                self._objects[device_id] = dev

    def info(self, device_id: str) -> DeviceInfo:
        """Facts about one device ("NODE/INDEX"); unknown ids raise InputError."""
        found = self._devices.get(device_id)
        if found is None:
            self.cluster.split_id(device_id)  # raises the one-line InputError
        return found  # type: ignore[return-value]

    def device(self, device_id: str) -> Device:
        """Cluster.device, cached."""
        found = self._objects.get(device_id)
        return found if found is not None else self.cluster.device(device_id)

    def link(self, a: str, b: str) -> Link:
        """Cluster.link, cached; links between nodes are cached per node pair."""
        key = (a, b) if a <= b else (b, a)
        found = self._links.get(key)
        if found is None:
            node_a, node_b = self._node_of.get(key[0]), self._node_of.get(key[1])
            if node_a is not None and node_b is not None and node_a != node_b:
                pair = (node_a, node_b) if node_a <= node_b else (node_b, node_a)
                node_key = ("@" + pair[0], "@" + pair[1])  # "@" never starts a device id key
                found = self._links.get(node_key)
                if found is None:
                    found = self.cluster.node_link(*pair)
                    self._links[node_key] = found
            else:
                found = self.cluster.link(*key)
            self._links[key] = found
        return found

    def peak(self, device_id: str, dtype: str) -> float:
        """Device.flops(dtype), cached: dense peak FLOP/s with the emulation slowdown applied."""
        key = (device_id, dtype)
        found = self._peaks.get(key)
        if found is None:
            found = self.device(device_id).flops(dtype)
            self._peaks[key] = found
        return found

    def rate(self, device_id: str, dtype: str, params: CostParams) -> float:
        """Achieved FLOP/s of a transformer layer on one device: rate x efficiency, slowdown applied.

        A device with a measured matmul rate (achieved_flops) uses it with `measured_compute_efficiency`: the
        rate measured in `dtype` itself, else (a native dtype) in fp16 for bf16 or in fp32, else (a dtype the
        device lacks) in fp32. Otherwise its dense peak (catalog or cluster file; `Device.flops`, at most the
        fp32 peak for a dtype it lacks) with the table's efficiency for the dtype it really computes in
        (`Device.compute_dtype`), or the default efficiency for a type the table does not know.
        """
        key = (device_id, dtype, params)
        found = self._rates.get(key)
        if found is None:
            dev = self.device(device_id)
            info = self.info(device_id)
            computed = dev.compute_dtype(dtype)
            achieved = dev.achieved_flops or {}
            fallback = ("fp16" if dtype == "bf16" else dtype, "fp32") if computed == dtype else ("fp32",)
            measured_rate = next((achieved[d] for d in (dtype, *fallback) if d in achieved), None)
            if measured_rate is not None:
                found = measured_rate / dev.slowdown * params.efficiency(info.type, computed, measured=True)
            else:  # datasheet peaks (from the catalog, or given in the cluster file): the default curve
                found = dev.flops(dtype) * params.efficiency(info.type, computed)
            self._rates[key] = found
        return found

    def compute_dtype(self, device_id: str, dtype: str) -> str:
        """Device.compute_dtype: `dtype` where the device computes it natively, else "fp32"."""
        return self.device(device_id).compute_dtype(dtype)


_VIEWS: OrderedDict[int, ClusterView] = OrderedDict()


def view(cluster: Cluster) -> ClusterView:
    """The cached view of `cluster` (identity-keyed, the last 16 clusters)."""
    key = id(cluster)
    found = _VIEWS.get(key)
    if found is not None and found.cluster is cluster:
        _VIEWS.move_to_end(key)
        return found
    found = ClusterView(cluster)
    _VIEWS[key] = found
    while len(_VIEWS) > _MAX_VIEWS:
        _VIEWS.popitem(last=False)
    return found

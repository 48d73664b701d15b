"""Idle devices of a plan, grouped for one line each: by node and device type, whole idle nodes of equal
hardware (same devices, fabric and NIC) that follow each other merged. `idle_measure` measures why each group
is idle; this module names the groups and writes the lines into the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...hardware.cluster import Cluster
from ...hardware.links import Link
from ...plan.schema import Plan, UnusedDevice
from .precision import lacking_types

# reasons that already say exactly why: the planner's "too small", the symmetric baseline's layout (its own
# rule leaves them idle), the fleet options' chosen or measured ones
KEEP_REASON_PREFIXES = ("too small: ", "uniform layout ", "excluded with --exclude", "left out by ")


@dataclass(frozen=True)
class IdleGroup:
    """Idle devices of one node group (cluster order), the node names, a label for humans
    ("node11 (8 x RTX-4090)") and the measured reason line."""

    devices: tuple[str, ...]
    nodes: tuple[str, ...]
    label: str
    reason: str


def node_content_key(cluster: Cluster, name: str) -> str:
    """Nodes with equal keys are identical hardware (devices, fabric, NIC; name and hostname aside)."""
    node = next(n for n in cluster.nodes if n.name == name)
    return node.model_dump_json(exclude={"name", "hostname"})


def devices_label(types: Sequence[str]) -> str:
    """"8 x RTX-4090", or "4 x A100-80G-SXM + 2 x T4" for mixed types (in order of appearance)."""
    counts: dict[str, int] = {}
    for t in types:
        counts[t] = counts.get(t, 0) + 1
    return " + ".join(f"{n} x {t}" for t, n in counts.items())


def link_text(link: Link) -> str:
    """A link for humans: "10 Gbit/s eth" (bandwidth in bit/s; `link.bandwidth` is bytes/s)."""
    return f"{link.bandwidth * 8 / 1e9:.3g} Gbit/s {link.kind}"


def group_idle(plan: Plan, cluster: Cluster) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    """(devices, nodes) of every idle group: by node and type, whole idle nodes of equal hardware that
    follow each other in the cluster merged. Devices whose reason is already exact (KEEP_REASON_PREFIXES)
    are left out."""
    keep = {u.device for u in plan.unused_devices if not u.reason.startswith(KEEP_REASON_PREFIXES)}
    groups: list[tuple[list[str], list[str], bool, str]] = []  # devices, nodes, whole node, content key
    for node in cluster.nodes:
        by_type: dict[str, list[str]] = {}
        for index, device in enumerate(node.devices):
            if f"{node.name}/{index}" in keep:
                by_type.setdefault(device.type, []).append(f"{node.name}/{index}")
        whole = sum(len(v) for v in by_type.values()) == len(node.devices) and len(by_type) == 1
        key = node_content_key(cluster, node.name)
        for devices in by_type.values():
            last = groups[-1] if groups else None
            if whole and last is not None and last[2] and last[3] == key:
                last[0].extend(devices)
                last[1].append(node.name)
            else:
                groups.append((list(devices), [node.name], whole, key))
    return [(tuple(d), tuple(n)) for d, n, _, _ in groups]


def group_label(cluster: Cluster, devices: Sequence[str], nodes: Sequence[str]) -> str:
    """"node11 (8 x RTX-4090)", or "node4..node7 (4 nodes of 8 x T4; measured on node4)" for merged nodes."""
    first = [d for d in devices if cluster.node_of(d) == nodes[0]]
    kind = devices_label([cluster.device(d).type for d in first])
    if len(nodes) == 1:
        return f"{nodes[0]} ({kind})"
    return f"{nodes[0]}..{nodes[-1]} ({len(nodes)} nodes of {kind}; measured on {nodes[0]})"


def dtype_note(cluster: Cluster, devices: Sequence[str], dtype: str) -> str:
    """"; T4 lacks bf16 (...)" when some of `devices` lack `dtype` (Device.compute_dtype), else ""."""
    lacking = lacking_types(cluster, devices, dtype)
    if not lacking:
        return ""
    fp16 = dtype == "bf16" and not lacking_types(cluster, devices, "fp16")
    return (f"; {', '.join(lacking)} lack{'s' if len(lacking) == 1 else ''} {dtype}: costed at no more than the "
            "fp32 rate" + (" (fp16 is native there: --dtype auto weighs it)" if fp16 else ""))


def with_measured_reasons(plan: Plan, groups: Sequence[IdleGroup]) -> Plan:
    """`plan` with every device of `groups` given its group's measured line as the reason it is idle."""
    reason = {d: group.reason for group in groups for d in group.devices}
    unused = [UnusedDevice(device=u.device, reason=reason.get(u.device, u.reason)) for u in plan.unused_devices]
    return plan.model_copy(update={"unused_devices": unused})

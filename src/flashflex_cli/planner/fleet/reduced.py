"""Reduced clusters: a cluster without some of its nodes, and its plans shown as plans of the whole cluster.

Nodes of identical hardware (same devices, fabric and NIC, name and hostname aside:
`idle_groups.node_content_key`) form a node class (`node_classes`); `--exclude` names nodes to leave out
(`parse_exclude`). A reduced cluster keeps the node-pair links between the nodes it keeps (`reduced_cluster`),
and a plan of it is shown on the whole cluster with every left-out device listed unused with its node's
reason (`on_full_cluster`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ...errors import InputError
from ...hardware.cluster import Cluster
from ...plan.schema import Plan, UnusedDevice
from .idle_groups import devices_label, node_content_key


@dataclass(frozen=True)
class NodeClass:
    """Nodes of identical hardware, in file order, and a label such as "8 x RTX-4090"."""

    label: str
    nodes: tuple[str, ...]


def node_classes(cluster: Cluster, allowed: Collection[str] | None = None) -> list[NodeClass]:
    """The node classes of `cluster` (only nodes in `allowed` when given), in order of first appearance."""
    found: dict[str, tuple[str, list[str]]] = {}
    for node in cluster.nodes:
        if allowed is not None and node.name not in allowed:
            continue
        key = node_content_key(cluster, node.name)
        label = devices_label([d.type for d in node.devices])
        found.setdefault(key, (label, []))[1].append(node.name)
    return [NodeClass(label, tuple(nodes)) for label, nodes in found.values()]


def node_label(cluster: Cluster, name: str) -> str:
    """"node3 (8 x A100-80G-SXM)"."""
    node = next(n for n in cluster.nodes if n.name == name)
    return f"{name} ({devices_label([d.type for d in node.devices])})"


def parse_exclude(cluster: Cluster, text: str | None) -> list[str]:
    """Node names of `--exclude a,b` (each must be a node of the cluster; not every node)."""
    if text is None:
        return []
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise InputError("--exclude: expected node names separated by commas, e.g. node3,node5")
    known = [node.name for node in cluster.nodes]
    unknown = [n for n in names if n not in known]
    if unknown:
        shown = ", ".join(known[:8]) + (" ..." if len(known) > 8 else "")
        raise InputError(f"--exclude: unknown node {unknown[0]!r} in cluster {cluster.name!r} (nodes: {shown})")
    if set(known) <= set(names):
        raise InputError(f"--exclude: leaves no node of cluster {cluster.name!r} to plan on")
    return list(dict.fromkeys(names))


def reduced_cluster(cluster: Cluster, keep: Collection[str]) -> Cluster:
    """`cluster` with only the nodes in `keep` (file order) and the node-pair links between them."""
    data = cluster.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["nodes"] = [node for node in data["nodes"] if node["name"] in keep]
    if not data["nodes"]:
        raise InputError(f"no node of cluster {cluster.name!r} left to plan on")
    inter = data.get("inter_node", {})
    inter["pairs"] = [pair for pair in inter.get("pairs", []) if pair["a"] in keep and pair["b"] in keep]
    return Cluster.model_validate(data)


def on_full_cluster(plan: Plan, cluster: Cluster, reasons: dict[str, str]) -> Plan:
    """A plan of a reduced cluster as a plan of `cluster`: its inputs name `cluster`, and every device of a
    node in `reasons` (the nodes left out) is listed unused with that node's reason, in cluster order."""
    inputs = plan.inputs.model_copy(update={"cluster_sha256": cluster.sha256(), "cluster_name": cluster.name})
    have = {u.device: u for u in plan.unused_devices}
    unused = []
    for device in cluster.device_ids:
        node = cluster.node_of(device)
        if node in reasons:
            unused.append(UnusedDevice(device=device, reason=reasons[node]))
        elif device in have:
            unused.append(have[device])
    return plan.model_copy(update={"inputs": inputs, "unused_devices": unused})

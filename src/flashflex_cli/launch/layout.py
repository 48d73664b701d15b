"""Which processes run on which host: a plan's devices grouped by node.

One plan node runs on one host. On a host, local rank i drives the i-th device of that node in plan
rank order (pipelines, stages, devices); the worker recovers its plan rank from (node, LOCAL_RANK)
the same way (`runtime.worker.plan_rank`), so torchrun's own rank numbering never matters.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hardware.cluster import Cluster
from ..plan.schema import Plan


@dataclass(frozen=True)
class NodeLayout:
    """One host of a launch: its plan node name, address, and plan ranks in local-rank order."""

    name: str
    host: str
    ranks: tuple[int, ...]
    devices: tuple[str, ...]

    @property
    def nproc(self) -> int:
        """Processes on this host."""
        return len(self.ranks)


def node_name(device_id: str) -> str:
    """The node part of "NODE/INDEX"."""
    return device_id.rpartition("/")[0]


def node_layouts(plan: Plan, cluster: Cluster | None = None, hosts: list[str] | None = None) -> list[NodeLayout]:
    """The hosts of a launch, in cluster node order (or order of first use without a cluster).

    `hosts` overrides each node's address (one per used node, in that order); otherwise the cluster's
    `hostname`, else the node name.
    """
    by_node: dict[str, list[tuple[int, str]]] = {}
    for info in plan.ranks():
        by_node.setdefault(node_name(info.device), []).append((info.rank, info.device))
    order = list(by_node)
    if cluster is not None:
        position = {node.name: i for i, node in enumerate(cluster.nodes)}
        order.sort(key=lambda name: position.get(name, len(position)))
    if hosts is not None and len(hosts) != len(order):
        from ..errors import InputError

        raise InputError(f"--hosts names {len(hosts)} hosts, the plan uses {len(order)} nodes ({', '.join(order)})")
    out = []
    for i, name in enumerate(order):
        if hosts is not None:
            host = hosts[i]
        elif cluster is not None:
            host = next((n.hostname for n in cluster.nodes if n.name == name and n.hostname), None) or name
        else:
            host = name
        entries = by_node[name]
        out.append(NodeLayout(name, host, tuple(r for r, _ in entries), tuple(d for _, d in entries)))
    return out

"""Merge node descriptions and cluster files into one cluster (`flashflex profile merge`)."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from ..errors import InputError
from .cluster import Cluster, InterNode, Node, NodePair


def cluster_of_nodes(
    nodes: Sequence[Node],
    name: str = "cluster",
    description: str | None = None,
    pairs: Sequence[NodePair] = (),
) -> Cluster:
    """Wrap nodes (and measured node pairs, bandwidth in bytes/s) into a validated Cluster."""
    names = [node.name for node in nodes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"node name used twice: {', '.join(duplicates)}")
    ordered = sorted(pairs, key=lambda p: (names.index(p.a), names.index(p.b)))
    try:
        return Cluster(name=name, description=description, nodes=list(nodes),
                       inter_node=InterNode(pairs=ordered))
    except ValidationError as exc:
        raise InputError(f"cannot build cluster {name!r}: {exc.errors()[0]['msg']}") from None


def merge_clusters(
    clusters: Sequence[Cluster],
    name: str = "cluster",
    description: str | None = None,
    sources: Sequence[str] | None = None,
) -> Cluster:
    """Concatenate the nodes of several clusters, keeping measured node pairs.

    Node names must be unique across all inputs (a collision names both files). Inter-node defaults
    (`default_bandwidth`, `latency_s`) are kept only where every input agrees on them.
    """
    if not clusters:
        raise InputError("profile merge: no input files")
    labels = list(sources) if sources is not None else [c.name for c in clusters]
    seen: dict[str, str] = {}
    nodes: list[Node] = []
    pairs: list[NodePair] = []
    for label, cluster in zip(labels, clusters, strict=True):
        for node in cluster.nodes:
            if node.name in seen:
                raise InputError(
                    f"node name {node.name!r} appears in both {seen[node.name]} and {label}; "
                    "rename one (flashflex profile --node-name)"
                )
            seen[node.name] = label
            nodes.append(node)
        pairs.extend(cluster.inter_node.pairs)
    merged = cluster_of_nodes(nodes, name=name, description=description, pairs=pairs)
    defaults = {(c.inter_node.default_bandwidth, c.inter_node.latency_s) for c in clusters}
    if len(defaults) == 1:
        bandwidth, latency = defaults.pop()
        merged = merged.model_copy(
            update={"inter_node": InterNode(default_bandwidth=bandwidth, latency_s=latency,
                                            pairs=merged.inter_node.pairs)}
        )
    return merged

"""Fast-link islands: the parts of a node inside which a TP group may live.

A node whose intra-node links are all alike (no `Node.intra_pairs`) is one island. A node with measured
pairs (e.g. a PCIe host with two sockets, whose cross-socket pairs are several times slower) is cut into
islands: the connected components of the graph whose edges are the device pairs linked at a bandwidth
(bytes/s) of at least `island_fraction` times the node's fastest intra-node link. Level 2 forms TP groups
inside one island only, so a TP group never straddles a slow link (ARCHITECTURE.md, "The planner").
"""

from __future__ import annotations

from ...hardware.cluster import Cluster

ISLAND_FRACTION = 0.5


def node_islands(cluster: Cluster, node_index: int, island_fraction: float | None = None) -> list[int]:
    """Island label (0, 1, ... in order of each island's lowest local index) of every device of one node.

    `island_fraction` (dimensionless, 0 <= f <= 1; default `ISLAND_FRACTION`, 0.5): a link joins two
    devices into one island when its bandwidth is at least this share of the node's fastest intra-node
    link (0 makes every node one island).
    """
    fraction = ISLAND_FRACTION if island_fraction is None else island_fraction
    node = cluster.nodes[node_index]
    count = len(node.devices)
    if not node.intra_pairs or count == 1:
        return [0] * count
    ids = [f"{node.name}/{i}" for i in range(count)]
    bw = {(i, j): cluster.link(ids[i], ids[j]).bandwidth for i in range(count) for j in range(i + 1, count)}
    floor = fraction * max(bw.values())
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for (i, j), value in sorted(bw.items()):
        if value >= floor:
            a, b = root(i), root(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
    labels: dict[int, int] = {}
    return [labels.setdefault(root(i), len(labels)) for i in range(count)]


def device_islands(cluster: Cluster, island_fraction: float | None = None) -> list[int]:
    """Cluster-wide island number of every device (cluster order); numbers ascend with node order, so two
    devices share a number only when they are on one node and in one fast-link island (`island_fraction`
    as in `node_islands`)."""
    out: list[int] = []
    offset = 0
    for n in range(len(cluster.nodes)):
        labels = node_islands(cluster, n, island_fraction)
        out.extend(offset + label for label in labels)
        offset += max(labels) + 1
    return out

"""Level 1: split the device graph into k groups, one per pipeline (data-parallel replica).

Three deterministic generators, all tried by the search:

- `metis_groups`: pymetis k-way partition of the device graph (`graph.DeviceGraph.csr`), vertices
  weighted by compute, edges by bandwidth, so the cut (where data-parallel gradient traffic flows
  between pipelines... and pipelines stay on fast links) falls on the slowest links; seeded through
  `pymetis.Options(seed=...)`.
- `contiguous_groups`: devices in cluster order cut into k runs of about equal compute (node-aligned
  when k <= nodes): keeps each pipeline on as few nodes as possible.
- `typed_groups`: devices sorted by (speed, memory) then cut like `contiguous_groups`: pipelines of
  like devices, whose stages balance easily.
- `striped_groups`: every node split k ways, so pipelines span the same nodes and data-parallel rings
  stay inside nodes (Holmes); only pipeline hops cross slow links.

METIS balances compute only approximately with heterogeneous weights; the search does not rely on
balance (micro-batches follow throughput) and refines groups afterwards with move/swap moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pymetis

from .graph import DeviceGraph


def _canonical(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """Sorted groups, ordered by their smallest device, empty ones dropped."""
    return sorted((sorted(int(i) for i in g) for g in groups if len(g)), key=lambda g: g[0])


def _cut(order: Sequence[int], weights: np.ndarray, k: int) -> list[list[int]]:
    """Cut `order` into k non-empty runs of about equal total weight."""
    count = len(order)
    if k >= count:
        return [[int(i)] for i in order]
    w = weights[np.asarray(order)]
    cum = np.cumsum(w)
    total = float(cum[-1])
    bounds = [0]
    for j in range(1, k):
        target = total * j / k
        pos = int(np.searchsorted(cum, target, side="left"))
        if pos + 1 < count and abs(cum[pos] - target) > abs((cum[pos - 1] if pos else 0.0) - target):
            pos -= 1
        pos = min(max(pos + 1, bounds[-1] + 1), count - (k - j))
        bounds.append(pos)
    bounds.append(count)
    return [[int(i) for i in order[bounds[j]:bounds[j + 1]]] for j in range(k)]


def contiguous_groups(graph: DeviceGraph, k: int, active: Sequence[int]) -> list[list[int]]:
    """k runs of the cluster order, equal compute; whole nodes per run when k <= nodes."""
    nodes = sorted({int(graph.node[i]) for i in active})
    if 1 < k <= len(nodes):
        node_flops = np.zeros(len(graph.cluster.nodes))
        np.add.at(node_flops, graph.node[list(active)], graph.flops[list(active)])
        runs = _cut(nodes, node_flops, k)
        node_of = graph.node_list
        return _canonical([[i for i in active if node_of[i] in members] for members in map(set, runs)])
    return _canonical(_cut(list(active), graph.flops, k))


def typed_groups(graph: DeviceGraph, k: int, active: Sequence[int]) -> list[list[int]]:
    """k runs of devices sorted by (FLOP/s, memory) descending, then cluster order."""
    order = sorted(active, key=lambda i: (-graph.flops[i], -graph.memory[i], i))
    return _canonical(_cut(order, graph.flops, k))


def striped_groups(graph: DeviceGraph, k: int, active: Sequence[int]) -> list[list[int]]:
    """Every node's devices cut into k contiguous runs, run j of every node going to pipeline j.

    Pipelines then span the same nodes, each stage's DP partners sit in its own node and gradient rings
    stay on the intra-node fabric, while only pipeline hops cross the slow links (Holmes, arXiv
    2312.03549: keep DP traffic inside the fast fabric).
    """
    groups: list[list[int]] = [[] for _ in range(k)]
    by_node: dict[int, list[int]] = {}
    for i in active:
        by_node.setdefault(int(graph.node[i]), []).append(i)
    for _, devs in sorted(by_node.items()):
        count = len(devs)
        parts = min(k, count)
        for j in range(parts):
            groups[j].extend(devs[j * count // parts:(j + 1) * count // parts])
    return _canonical(groups)


def metis_groups(graph: DeviceGraph, k: int, seed: int, active: Sequence[int]) -> list[list[int]]:
    """pymetis k-way partition of the active devices' subgraph (compute-balanced, cutting slow links)."""
    active = list(active)
    if k <= 1:
        return [active]
    if k >= len(active):
        return [[i] for i in active]
    xadj, adjncy, weights, vweights = graph.sub_csr(tuple(active))
    options = pymetis.Options(seed=seed)
    if hasattr(pymetis, "CSRAdjacency"):
        result = pymetis.part_graph(k, pymetis.CSRAdjacency(xadj, adjncy), vweights=vweights, eweights=weights,
                                    options=options)
    else:  # older pymetis
        result = pymetis.part_graph(k, xadj=xadj, adjncy=adjncy, vweights=vweights, eweights=weights,
                                    options=options)
    groups: list[list[int]] = [[] for _ in range(k)]
    for n, p in enumerate(result[1]):
        groups[int(p)].append(active[n])
    return _canonical(groups)


def generators(graph: DeviceGraph, k: int, seed: int,
               active: Sequence[int] | None = None) -> list[tuple[str, list[list[int]]]]:
    """Every distinct level-1 partition of the `active` devices (default all) for k pipelines, in a
    fixed order; memoised on the graph (every search of one cluster partitions the same way: the sharded
    searches repeat the unsharded one's pipeline counts)."""
    active = sorted(range(graph.size) if active is None else active)
    memo, key = graph.partition_memo, (k, seed, tuple(active))
    found = memo.get(key)
    if found is None:
        out: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
        seen: set[tuple] = set()
        for name, groups in (("metis", metis_groups(graph, k, seed, active)),
                             ("contiguous", contiguous_groups(graph, k, active)),
                             ("typed", typed_groups(graph, k, active)),
                             ("striped", striped_groups(graph, k, active))):
            partition = tuple(tuple(g) for g in groups)
            if partition not in seen:
                seen.add(partition)
                out.append((name, partition))
        found = memo[key] = tuple(out)
    return [(name, [list(g) for g in groups]) for name, groups in found]


def device_subsets(graph: DeviceGraph, max_drops: int = 3) -> list[list[int]]:
    """All devices, then without the slowest kind of device, without the two slowest kinds, ...

    A kind is (FLOP/s, memory); kinds are dropped slowest (then smallest) first, at most `max_drops`,
    always keeping at least one kind. Slow devices can cost more (as pipeline bottlenecks or DP partners)
    than they add."""
    kinds = sorted({(float(graph.flops[i]), float(graph.memory[i])) for i in range(graph.size)})
    out = [list(range(graph.size))]
    for drop in range(1, min(max_drops, len(kinds) - 1) + 1):
        gone = set(kinds[:drop])
        out.append([i for i in range(graph.size) if (float(graph.flops[i]), float(graph.memory[i])) not in gone])
    return out

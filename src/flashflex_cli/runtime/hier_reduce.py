"""Hierarchical all-reduce of one gradient bucket whose holders sit on several nodes.

Schedule (per bucket of S bytes, holders on m nodes, k_i of them on node i; node = the part of the device name
before "/"):
1. inside each node with k_i >= 2: reduce to the node's leader (its lowest rank) over the fast intra-node link;
2. the m leaders all-reduce the partial sums across nodes (the only step on the slow inter-node path);
3. inside each node: the leader broadcasts the result to the others.

Why reduce / all-reduce / broadcast rather than reduce-scatter, all-reduce of 1/k, all-gather: the holders of
a slice are one or two ranks per holding stage, so nodes hold unequal numbers of them (k_i differ), which the
reduce-scatter form cannot split evenly; and where one NIC per node carries all inter-node traffic (the case
Holmes, arXiv 2312.03549, designs for, and the emulated hosts of this project) both forms put the same
2 (m - 1) / m x S bytes through each node's NIC, against 2 (N - 1) / N x S per ring hop for the flat ring over
all N = sum k_i holders, in 2 (m - 1) instead of 2 (N - 1) latency-bound steps.

`node_splits` is pure (plan -> splits); the groups it names are created by `groups.build_groups`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..plan.schema import Plan


def node_of(device: str) -> str:
    """The node of a device name "node/index" (the whole name when it has no "/")."""
    return device.split("/", 1)[0]


@dataclass(frozen=True)
class NodeSplit:
    """The holders of one bucket (`members`, sorted) grouped by node: `parts[i]` the sorted holders on one node,
    parts ordered by their lowest rank (the node's leader)."""

    members: tuple[int, ...]
    parts: tuple[tuple[int, ...], ...]

    @property
    def leaders(self) -> tuple[int, ...]:
        """One rank per node: the lowest holder on it."""
        return tuple(part[0] for part in self.parts)

    @property
    def hierarchical(self) -> bool:
        """True when the holders span two or more nodes and some node has two or more of them (otherwise the
        hierarchy is the flat all-reduce)."""
        return len(self.parts) > 1 and any(len(part) > 1 for part in self.parts)

    def groups_needed(self) -> list[tuple[int, ...]]:
        """The process groups this schedule uses: every part with two or more ranks, then the leaders."""
        if not self.hierarchical:
            return []
        return [part for part in self.parts if len(part) > 1] + [self.leaders]


def node_split(plan: Plan, members: tuple[int, ...]) -> NodeSplit:
    """Group the ranks `members` of `plan` by the node of their device."""
    ranks = plan.ranks()
    by_node: dict[str, list[int]] = {}
    for r in sorted(members):
        by_node.setdefault(node_of(ranks[r].device), []).append(r)
    parts = sorted((tuple(v) for v in by_node.values()), key=lambda part: part[0])
    return NodeSplit(tuple(sorted(members)), tuple(parts))


def node_splits(plan: Plan, holder_sets: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], NodeSplit]:
    """The NodeSplit of every holder set that spans nodes hierarchically (others are left out: flat)."""
    out: dict[tuple[int, ...], NodeSplit] = {}
    for members in holder_sets:
        split = node_split(plan, members)
        if split.hierarchical:
            out[split.members] = split
    return out


def hierarchical_groups(splits: Iterable[NodeSplit]) -> list[tuple[int, ...]]:
    """Every distinct rank tuple the splits need a process group for, sorted (the creation order)."""
    return sorted({g for split in splits for g in split.groups_needed()})


def hier_all_reduce(flat: torch.Tensor, split: NodeSplit, rank: int,
                    groups: dict[tuple[int, ...], dist.ProcessGroup]) -> float:
    """Sum `flat` (any shape, this rank's contribution; the sum on return) over `split.members` by the
    three-step schedule above (blocking; collective over this rank's node part and, for leaders, the leaders).
    Returns the wall seconds of step 2 on this rank (0 unless it is a leader; on CUDA the time to enqueue)."""
    part = next(p for p in split.parts if rank in p)
    leader = part[0]
    across = 0.0
    if len(part) > 1:
        dist.reduce(flat, dst=leader, group=groups[part])
    if rank == leader:
        start = time.perf_counter()
        dist.all_reduce(flat, group=groups[split.leaders])
        across = time.perf_counter() - start
    if len(part) > 1:
        dist.broadcast(flat, src=leader, group=groups[part])
    return across

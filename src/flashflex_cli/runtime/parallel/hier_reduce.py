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

Each rank issues its steps as a chain of asynchronous collectives (`hier_chain`, runtime/parallel/collective_chain.py),
so the training thread never blocks on the reduction before the end of the step's schedule.

The node splits are pure (semantics/process_groups.py: plan -> splits); the groups they name are created by
`groups.build_groups`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...semantics.process_groups import NodeSplit, hierarchical_groups, node_of, node_split, node_splits
from .collective_chain import Chain, Step

__all__ = ["NodeSplit", "hier_chain", "hierarchical_groups", "node_of", "node_split", "node_splits"]


def hier_chain(flat: torch.Tensor, split: NodeSplit, rank: int,
               groups: dict[tuple[int, ...], dist.ProcessGroup]) -> Chain:
    """This rank's part of summing `flat` (any shape; this rank's contribution, the sum once the chain is done)
    over `split.members` by the three-step schedule above, as a chain of asynchronous collectives
    (runtime/parallel/collective_chain.py): a reduce inside the node, for the node's leader the all-reduce across the
    leaders (the chain's timed step), then the broadcast inside the node. Each step reads what the one before it
    wrote, so the chain issues it only once that is there."""
    part = next(p for p in split.parts if rank in p)
    leader = part[0]
    steps: list[Step] = []
    timed: frozenset[int] = frozenset()
    if len(part) > 1:
        steps.append(lambda: dist.reduce(flat, dst=leader, group=groups[part], async_op=True))
    if rank == leader:
        timed = frozenset({len(steps)})
        steps.append(lambda: dist.all_reduce(flat, group=groups[split.leaders], async_op=True))
    if len(part) > 1:
        steps.append(lambda: dist.broadcast(flat, src=leader, group=groups[part], async_op=True))
    return Chain(steps, timed)

"""Every process group of a plan, built from the plan alone and in the same order on every rank.

Which ranks form which group, and the order of creation, is `semantics/process_groups.group_members` (every rank
calls `torch.distributed.new_group` for every group, member or not): one TP group per stage with tp > 1; one
data-parallel group per distinct set of ranks holding a matching slice of some parameter in two or more stages
(`slice_holders`, sorted by rank tuple); the world group; the hierarchical reduction's intra-node parts and
leader sets. The cost model counts the same list to charge each GPU rank its NCCL communicators.

Stage boundaries where the TP degree changes (sender stage of tp_s ranks, receiver stage of tp_r ranks; the
activation [mbs, seq, hidden] is replicated within each group): receiver j takes the activation from sender
j % tp_s; sender i takes the gradient from receiver i % tp_r (every receiver's input gradient is the full,
identical gradient of the replicated input). That is the full-copy path; with lean transfers (the default,
RuntimeOptions.lean_p2p) each side sends only its chunks to the whole adjacent stage (`PlanGroups.prev_stage`,
`next_stage`; the mapping is semantics/boundary.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ...plan.schema import Plan
from ...semantics.process_groups import (
    NodeSplit,
    SliceHolders,
    group_members,
    holder_sets,
    node_splits,
    slice_holders,
    stage_ranks,
)
from ..model.tensor_parallel import TPContext

__all__ = ["PlanGroups", "SliceHolders", "adjacent_stages", "build_groups", "neighbours", "slice_holders",
           "stage_ranks"]


@dataclass
class PlanGroups:
    """What one rank needs to communicate: its place in the plan, its TP group, its pipeline neighbours'
    ranks, and the data-parallel groups keyed by the sorted tuple of member ranks."""

    rank: int
    world_size: int
    pipeline: int
    stage: int
    tp_rank: int
    tp_size: int
    tp_group: dist.ProcessGroup | None
    world_group: dist.ProcessGroup | None
    recv_act_from: int | None
    send_act_to: tuple[int, ...]
    recv_grad_from: int | None
    send_grad_to: tuple[int, ...]
    slices: list[SliceHolders]
    dp_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    prev_stage: tuple[int, ...] = ()  # ranks of the previous stage of this pipeline (TP order; () on the first)
    next_stage: tuple[int, ...] = ()  # ranks of the next stage (() on the last)
    # hierarchical DP (runtime/parallel/hier_reduce.py): the node split of every holder set spanning nodes, and the
    # intra-node and leader groups this rank belongs to, keyed by sorted member ranks
    node_splits: dict[tuple[int, ...], NodeSplit] = field(default_factory=dict)
    node_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    # gloo: the timeout the pipeline's point-to-point waits use (gloo's sends and receives keep the timeout their
    # group was made with; runtime/parallel/timeouts.py sets this when it changes the groups'); None: that one
    p2p_wait: timedelta | None = None
    # a plan of replica groups (semantics/outer_sync.py): `world_group` is this rank's replica group (loss, norm,
    # pipeline transfers), `job_group` every rank of the job, `outer_groups` the outer step's holder sets
    job_group: dist.ProcessGroup | None = None
    outer_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    def member_groups(self) -> list[dist.ProcessGroup]:
        """Every group built for the plan that this rank belongs to (TP, world, DP, hierarchical), once each."""
        found = [self.tp_group, self.world_group, *self.dp_groups.values(), *self.node_groups.values(),
                 self.job_group, *self.outer_groups.values()]
        out: list[dist.ProcessGroup] = []
        for group in found:
            if group is not None and all(group is not seen for seen in out):
                out.append(group)
        return out

    def tp_context(self) -> TPContext:
        """A fresh TPContext over this rank's TP group."""
        return TPContext(group=self.tp_group, size=self.tp_size, rank=self.tp_rank)


def neighbours(plan: Plan, rank: int) -> tuple[int | None, tuple[int, ...], int | None, tuple[int, ...]]:
    """(recv_act_from, send_act_to, recv_grad_from, send_grad_to) for `rank` (see the module docstring)."""
    info = plan.ranks()[rank]
    ranks = stage_ranks(plan)[info.pipeline]
    s, i = info.stage, info.tp_rank
    recv_act = recv_grad = None
    send_act: tuple[int, ...] = ()
    send_grad: tuple[int, ...] = ()
    if s > 0:
        prev = ranks[s - 1]
        recv_act = prev[i % len(prev)]
        send_grad = tuple(prev[k] for k in range(len(prev)) if k % len(ranks[s]) == i)
    if s + 1 < len(ranks):
        nxt = ranks[s + 1]
        send_act = tuple(nxt[j] for j in range(len(nxt)) if j % len(ranks[s]) == i)
        recv_grad = nxt[i % len(nxt)]
    return recv_act, send_act, recv_grad, send_grad


def adjacent_stages(plan: Plan, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ranks of the previous stage, ranks of the next stage) of `rank`'s pipeline, () where there is none:
    the two ends of the lean boundary transfers (`semantics/boundary.ChunkPlan`)."""
    info = plan.ranks()[rank]
    ranks = stage_ranks(plan)[info.pipeline]
    s = info.stage
    return (tuple(ranks[s - 1]) if s > 0 else (), tuple(ranks[s + 1]) if s + 1 < len(ranks) else ())


def build_groups(plan: Plan, rank: int, backend: str | None = None, timeout: timedelta | None = None) -> PlanGroups:
    """Create every process group of `plan` (collective: every rank of the job calls it, same plan).

    Needs `torch.distributed` initialised with world size `plan.world_size`. `backend` and `timeout` (the
    collective timeout; None: torch's default of 30 minutes, not the default group's) are passed to `new_group`.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised")
    if dist.get_world_size() != plan.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} != plan world size {plan.world_size}")
    me = plan.ranks()[rank]
    tp_group = world_group = job_group = None
    dp_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    node_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    outer_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for spec in group_members(plan):
        group = dist.new_group(list(spec.members), backend=backend, timeout=timeout)
        if rank not in spec.members:
            continue
        if spec.role == "tp":
            tp_group = group
        elif spec.role == "dp":
            dp_groups[spec.members] = group
        elif spec.role == "world":
            world_group = job_group = group
        elif spec.role == "replica":  # created after the world: this rank's replica group replaces it
            world_group = group
        elif spec.role == "outer":
            outer_groups[spec.members] = group
        else:
            node_groups[spec.members] = group
    slices = slice_holders(plan)
    splits = node_splits(plan, holder_sets(slices))
    recv_act, send_act, recv_grad, send_grad = neighbours(plan, rank)
    prev_stage, next_stage = adjacent_stages(plan, rank)
    stage = plan.pipelines[me.pipeline].stages[me.stage]
    return PlanGroups(rank=rank, world_size=plan.world_size, pipeline=me.pipeline, stage=me.stage,
                      tp_rank=me.tp_rank, tp_size=stage.tp, tp_group=tp_group, world_group=world_group,
                      recv_act_from=recv_act, send_act_to=send_act, recv_grad_from=recv_grad,
                      send_grad_to=send_grad, slices=slices, dp_groups=dp_groups,
                      prev_stage=prev_stage, next_stage=next_stage,
                      node_splits={k: v for k, v in splits.items() if rank in k}, node_groups=node_groups,
                      job_group=job_group, outer_groups=outer_groups)

"""Every process group of a plan, built from the plan alone and in the same order on every rank.

Order of creation (every rank calls `torch.distributed.new_group` for every group, member or not):
1. one TP group per stage with tp > 1 (pipelines in order, stages in order);
2. one data-parallel group per distinct set of ranks that hold a matching slice of some parameter in two or
   more stages (sorted by rank tuple);
3. the world group;
4. for holder sets spanning several nodes, every intra-node part and leader set of the hierarchical
   reduction (`hier_reduce.hierarchical_groups`, sorted by rank tuple).

Data parallelism across unlike pipelines: for every global parameter, each pipeline's stage holding it splits
it into `tp` slices along its shard dimension. Taking every slice boundary of every holding stage partitions the
full tensor into the finest common slices; each such slice is summed over exactly the ranks holding it, one
contribution per holding stage (`SliceHolders.contributors`), never by gathering whole replicas.
Tied embeddings: in a pipeline of two or more stages, the first stage (lookup) and the last stage (output
projection) both hold "embed" and each has a partial gradient; both are holding stages, so the same sums add
them (within the pipeline and across pipelines) and every copy steps with the full gradient.

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

from ..plan.schema import Plan, StagePlan
from ..semantics.parameters import ParamInfo, model_params, shard_bounds
from .hier_reduce import NodeSplit, hierarchical_groups, node_splits
from .tensor_parallel import TPContext


@dataclass(frozen=True)
class SliceHolders:
    """The finest common slice [start, stop) along `dim` of global parameter `name` (dim None: whole tensor),
    the ranks that hold it (sorted), one contributing rank per holding stage, and the rank that counts it once
    in the gradient norm (`owner`). `stages`: how many stages hold it (one per pipeline; two in a pipeline
    whose first and last stages both hold a tied embedding). `tied`: the first and the last stage of some
    pipeline both hold it (a tied embedding)."""

    name: str
    dim: int | None
    start: int
    stop: int
    ranks: tuple[int, ...]
    contributors: tuple[int, ...]
    stages: int
    tied: bool = False

    @property
    def owner(self) -> int:
        """The lowest holding rank."""
        return self.ranks[0]

    @property
    def needs_reduce(self) -> bool:
        """True when two or more stages hold this slice (pipelines, or the two ends of a tied embedding)."""
        return self.stages > 1


def _stages_of(plan: Plan, pipeline: int, info: ParamInfo) -> list[int]:
    """The stages of `pipeline` holding `info`: one, or the first and the last for a tied embedding."""
    stages = plan.pipelines[pipeline].stages
    last = len(stages) - 1
    if info.name == "embed":
        return [0, last] if plan.inputs.model.tie_embeddings and last > 0 else [0]
    if info.name in ("norm", "head"):
        return [last]
    layer = int(info.name.split(".")[1])
    return [next(s for s, st in enumerate(stages) if st.layers[0] <= layer < st.layers[1])]


def stage_ranks(plan: Plan) -> list[list[list[int]]]:
    """ranks[p][s] = the global ranks of stage s of pipeline p (TP order)."""
    out: list[list[list[int]]] = []
    rank = 0
    for pipe in plan.pipelines:
        out.append([])
        for stage in pipe.stages:
            out[-1].append(list(range(rank, rank + stage.tp)))
            rank += stage.tp
    return out


def slice_holders(plan: Plan) -> list[SliceHolders]:
    """Every finest common slice of every parameter with its holders, in a fixed global order."""
    ranks = stage_ranks(plan)
    out: list[SliceHolders] = []
    for info in model_params(plan.inputs.model):
        holding: list[tuple[StagePlan, list[int]]] = []
        tied = False
        for p in range(len(plan.pipelines)):
            stages = _stages_of(plan, p, info)
            tied = tied or len(stages) > 1
            for s in stages:
                holding.append((plan.pipelines[p].stages[s], ranks[p][s]))
        if info.shard_dim is None:
            members = tuple(sorted(r for _, rs in holding for r in rs))
            contributors = tuple(rs[0] for _, rs in holding)
            out.append(SliceHolders(info.name, None, 0, info.shape[0], members, contributors, len(holding), tied))
            continue
        n = info.shape[info.shard_dim]
        cuts = sorted({b for st, _ in holding for t in range(st.tp) for b in shard_bounds(n, st.tp, t)})
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            owners = []
            for st, rs in holding:
                t = next(t for t in range(st.tp) if shard_bounds(n, st.tp, t)[0] <= a < shard_bounds(n, st.tp, t)[1])
                owners.append(rs[t])
            out.append(SliceHolders(info.name, info.shard_dim, a, b, tuple(sorted(owners)), tuple(owners),
                                    len(holding), tied))
    return out


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
    # hierarchical DP (runtime/hier_reduce.py): the node split of every holder set spanning nodes, and the
    # intra-node and leader groups this rank belongs to, keyed by sorted member ranks
    node_splits: dict[tuple[int, ...], NodeSplit] = field(default_factory=dict)
    node_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    # gloo: the timeout the pipeline's point-to-point waits use (gloo's sends and receives keep the timeout their
    # group was made with; runtime/timeouts.py sets this when it changes the groups'); None: that one
    p2p_wait: timedelta | None = None

    def member_groups(self) -> list[dist.ProcessGroup]:
        """Every group built for the plan that this rank belongs to (TP, world, DP, hierarchical), once each."""
        found = [self.tp_group, self.world_group, *self.dp_groups.values(), *self.node_groups.values()]
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
    tp_group = None
    for p, pipe_ranks in enumerate(stage_ranks(plan)):
        for s, members in enumerate(pipe_ranks):
            if len(members) > 1:
                group = dist.new_group(members, backend=backend, timeout=timeout)
                if (p, s) == (me.pipeline, me.stage):
                    tp_group = group
    slices = slice_holders(plan)
    dp_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for members in sorted({sl.ranks for sl in slices if sl.needs_reduce}):
        group = dist.new_group(list(members), backend=backend, timeout=timeout)
        if rank in members:
            dp_groups[members] = group
    world_group = dist.new_group(list(range(plan.world_size)), backend=backend, timeout=timeout)
    # Last: the hierarchical DP groups (intra-node parts, then leaders), created whatever the runtime options.
    splits = node_splits(plan, sorted({sl.ranks for sl in slices if sl.needs_reduce}))
    node_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for members in hierarchical_groups(splits.values()):
        group = dist.new_group(list(members), backend=backend, timeout=timeout)
        if rank in members:
            node_groups[members] = group
    recv_act, send_act, recv_grad, send_grad = neighbours(plan, rank)
    prev_stage, next_stage = adjacent_stages(plan, rank)
    stage = plan.pipelines[me.pipeline].stages[me.stage]
    return PlanGroups(rank=rank, world_size=plan.world_size, pipeline=me.pipeline, stage=me.stage,
                      tp_rank=me.tp_rank, tp_size=stage.tp, tp_group=tp_group, world_group=world_group,
                      recv_act_from=recv_act, send_act_to=send_act, recv_grad_from=recv_grad,
                      send_grad_to=send_grad, slices=slices, dp_groups=dp_groups,
                      prev_stage=prev_stage, next_stage=next_stage,
                      node_splits={k: v for k, v in splits.items() if rank in k}, node_groups=node_groups)

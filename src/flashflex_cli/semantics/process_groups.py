"""Which ranks of a plan form which process groups: pure functions of the plan's layout, torch-free.

The runtime creates exactly these groups (runtime/parallel/groups.py `build_groups`, in `group_members`' order) and the
cost model charges each GPU rank one NCCL communicator per group it belongs to (cost/memory.py), so both read
the one list here. The plan is taken as it is (duck-typed: `pipelines[p].stages[s]` with `tp`, `layers` and
`devices`, `inputs.model` a ModelSpec), since this part may not import the plan format.

Data parallelism across unlike pipelines: for every global parameter, each pipeline's stage holding it splits
it into `tp` slices along its shard dimension. Taking every slice boundary of every holding stage partitions the
full tensor into the finest common slices; each such slice is summed over exactly the ranks holding it, one
contribution per holding stage (`SliceHolders.contributors`). Tied embeddings: in a pipeline of two or more
stages, the first stage (lookup) and the last stage (output projection) both hold "embed".

Hierarchical reduction (runtime/parallel/hier_reduce.py): the holders of a slice grouped by node (the part of the device
name before "/"); where they span two or more nodes and some node has two or more of them, each node's part and
the nodes' leaders (lowest rank per node) get a group.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .outer_sync import group_pipelines, group_ranks, grouped
from .parameters import ParamInfo, model_params, shard_bounds


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


def layer_stages(plan: Any) -> list[list[int]]:
    """table[p][layer] = the stage of pipeline p that holds transformer layer `layer`."""
    table = []
    for pipe in plan.pipelines:
        row: list[int] = []
        for s, stage in enumerate(pipe.stages):
            row.extend([s] * (stage.layers[1] - stage.layers[0]))
        table.append(row)
    return table


def _holding_stages(plan: Any, info: ParamInfo, pipelines: list[int], table: list[list[int]]) -> list[tuple[int, int]]:
    """(pipeline, stage) of every stage of `pipelines` holding `info`: one per pipeline, or its first and last
    for a tied embedding (`table`: `layer_stages(plan)`)."""
    if info.name == "embed":
        tied = plan.inputs.model.tie_embeddings
        out = []
        for p in pipelines:
            last = len(plan.pipelines[p].stages) - 1
            out += [(p, 0), (p, last)] if tied and last > 0 else [(p, 0)]
        return out
    if info.name in ("norm", "head"):
        return [(p, len(plan.pipelines[p].stages) - 1) for p in pipelines]
    layer = int(info.name.split(".")[1])
    return [(p, table[p][layer]) for p in pipelines]


def stage_ranks(plan: Any) -> list[list[list[int]]]:
    """ranks[p][s] = the global ranks of stage s of pipeline p (TP order)."""
    out: list[list[list[int]]] = []
    rank = 0
    for pipe in plan.pipelines:
        out.append([])
        for stage in pipe.stages:
            out[-1].append(list(range(rank, rank + stage.tp)))
            rank += stage.tp
    return out


def rank_devices(plan: Any) -> list[str]:
    """The device of every rank, in rank order (pipelines, stages, TP ranks)."""
    return [device for pipe in plan.pipelines for stage in pipe.stages for device in stage.devices]


_HOLDERS: dict[tuple, list[SliceHolders]] = {}  # the last few layouts' slices (a plan is estimated several times)
_HOLDERS_KEPT = 8


def layout_key(plan: Any) -> tuple:
    """What `slice_holders` depends on: the model's shape and every stage's TP degree and layers, in order."""
    stages = tuple(tuple((st.tp, tuple(st.layers)) for st in pipe.stages) for pipe in plan.pipelines)
    return plan.inputs.model.model_dump_json(), stages


def slice_holders(plan: Any) -> list[SliceHolders]:
    """Every finest common slice of every parameter with its holders, in a fixed global order: the gradient
    reduction's slices. A plan of replica groups (semantics/outer_sync.py) reduces gradients inside each group
    only: each parameter's slices of group 0, then of group 1, and so on. The list of the same layout is computed
    once and shared: do not modify it."""
    groups = group_pipelines(plan)
    key = (layout_key(plan), tuple(tuple(g) for g in groups))
    found = _HOLDERS.get(key)
    if found is None:
        found = _holders(plan, groups)
        if len(_HOLDERS) >= _HOLDERS_KEPT:
            _HOLDERS.pop(next(iter(_HOLDERS)))
        _HOLDERS[key] = found
    return found


def outer_slice_holders(plan: Any) -> list[SliceHolders]:
    """The finest common slices over every pipeline of the plan, whatever its replica groups: what the outer step
    of a plan of replica groups all-reduces (pseudo-gradients, runtime/parallel/outer_sync.py)."""
    return _holders(plan, [list(range(len(plan.pipelines)))])


def _holders(plan: Any, pipeline_sets: list[list[int]]) -> list[SliceHolders]:
    """The finest common slices of every parameter among the pipelines of each set (parameters first, then sets).
    Parameters held by the same stages and cut along an equally long dimension (a layer's projections, layers
    that sit in the same stage of every pipeline) share one computation of their slices (`cuts`)."""
    ranks, table = stage_ranks(plan), layer_stages(plan)
    cuts: dict[tuple, list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]] = {}
    out: list[SliceHolders] = []
    for info in model_params(plan.inputs.model):
        for pipelines in pipeline_sets:
            out += _param_holders(plan, info, pipelines, ranks, table, cuts)
    return out


def _param_holders(plan: Any, info: ParamInfo, pipelines: list[int], ranks: list[list[list[int]]],
                   table: list[list[int]], cuts: dict[tuple, list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]]
                   ) -> list[SliceHolders]:
    """The finest common slices of one parameter among `pipelines`; `cuts`: the slices (start, stop, sorted holders,
    holders by stage) already found, by holding stages and length."""
    holding = _holding_stages(plan, info, pipelines, table)
    tied = len(holding) > len(pipelines)
    if info.shard_dim is None:
        members = tuple(sorted(r for p, s in holding for r in ranks[p][s]))
        contributors = tuple(ranks[p][s][0] for p, s in holding)
        return [SliceHolders(info.name, None, 0, info.shape[0], members, contributors, len(holding), tied)]
    n = info.shape[info.shard_dim]
    key = (tuple(holding), n)
    found = cuts.get(key)
    if found is None:
        found = cuts[key] = _slices(n, [(plan.pipelines[p].stages[s].tp, ranks[p][s]) for p, s in holding])
    return [SliceHolders(info.name, info.shard_dim, a, b, members, owners, len(holding), tied)
            for a, b, members, owners in found]


def _slices(n: int, holding: list[tuple[int, list[int]]]) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """The finest common slices [start, stop) of an n-long dimension split by holding stages of (TP degree, ranks):
    (start, stop, holders sorted, holders in stage order)."""
    bounds = sorted({b for tp, _ in holding for t in range(tp) for b in shard_bounds(n, tp, t)})
    out = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        # the floor split's shard holding index a, on each stage
        owners = tuple([rs[min(tp - 1, ((a + 1) * tp - 1) // n)] for tp, rs in holding])
        out.append((a, b, tuple(sorted(owners)), owners))
    return out


def holder_sets(slices: Iterable[SliceHolders]) -> list[tuple[int, ...]]:
    """The distinct holder sets of the slices that need a reduction, sorted (one DP group each)."""
    return sorted({sl.ranks for sl in slices if sl.needs_reduce})


# ---- hierarchical reduction: holders grouped by node -----------------------------------------------------------

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


def node_split(plan: Any, members: tuple[int, ...], devices: list[str] | None = None) -> NodeSplit:
    """Group the ranks `members` of `plan` by the node of their device (`devices`: `rank_devices(plan)`, when
    the caller has it)."""
    devices = devices if devices is not None else rank_devices(plan)
    by_node: dict[str, list[int]] = {}
    for r in sorted(members):
        by_node.setdefault(node_of(devices[r]), []).append(r)
    parts = sorted((tuple(v) for v in by_node.values()), key=lambda part: part[0])
    return NodeSplit(tuple(sorted(members)), tuple(parts))


def node_splits(plan: Any, holder_sets: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], NodeSplit]:
    """The NodeSplit of every holder set that spans nodes hierarchically (others are left out: flat)."""
    out: dict[tuple[int, ...], NodeSplit] = {}
    devices = rank_devices(plan)
    for members in holder_sets:
        split = node_split(plan, members, devices)
        if split.hierarchical:
            out[split.members] = split
    return out


def hierarchical_groups(splits: Iterable[NodeSplit]) -> list[tuple[int, ...]]:
    """Every distinct rank tuple the splits need a process group for, sorted (the creation order)."""
    return sorted({g for split in splits for g in split.groups_needed()})


# ---- every group, and the communicators of a rank ---------------------------------------------------------------

@dataclass(frozen=True)
class GroupSpec:
    """One process group the runtime creates: its members (sorted ranks) and its role ("tp", "dp", "world",
    "hierarchical")."""

    members: tuple[int, ...]
    role: str


def group_members(plan: Any) -> list[GroupSpec]:
    """Every group `build_groups` creates beyond the default one, in creation order: one TP group per stage of
    two or more devices (pipelines, then stages); one DP group per holder set; the world; the hierarchical
    reduction's groups (intra-node parts and leaders, created whatever the runtime options); in a plan of
    replica groups, one group per replica group and one per holder set of the outer step."""
    out = [GroupSpec(tuple(members), "tp") for pipe in stage_ranks(plan) for members in pipe if len(members) > 1]
    sets = holder_sets(slice_holders(plan))
    out += [GroupSpec(members, "dp") for members in sets]
    world = sum(stage.tp for pipe in plan.pipelines for stage in pipe.stages)
    out.append(GroupSpec(tuple(range(world)), "world"))
    out += [GroupSpec(members, "hierarchical") for members in hierarchical_groups(node_splits(plan, sets).values())]
    if grouped(plan):  # replica groups: each group's own "world", then the outer step's holder sets
        out += [GroupSpec(members, "replica") for members in group_ranks(plan)]
        out += [GroupSpec(members, "outer") for members in holder_sets(outer_slice_holders(plan))]
    return out


def communicator_groups(plan: Any) -> list[tuple[int, ...]]:
    """The members of every NCCL communicator of the job, one entry per communicator (two equal groups are two
    communicators): the default group (every rank) and every group of `group_members` with two or more ranks."""
    world = sum(stage.tp for pipe in plan.pipelines for stage in pipe.stages)
    out = [tuple(range(world))] if world > 1 else []
    return out + [spec.members for spec in group_members(plan) if len(spec.members) > 1]


def rank_communicators(plan: Any) -> list[list[tuple[int, ...]]]:
    """Per rank, the members of every NCCL communicator it holds: the default group (every rank) and every group
    of `group_members` it belongs to, counting only groups of two or more ranks (a one-rank communicator connects
    to no peer)."""
    world = sum(stage.tp for pipe in plan.pipelines for stage in pipe.stages)
    out: list[list[tuple[int, ...]]] = [[] for _ in range(world)]
    for members in communicator_groups(plan):
        for rank in members:
            out[rank].append(members)
    return out


def communicators(plan: Any) -> list[int]:
    """Per rank, how many NCCL communicators it holds (`rank_communicators`)."""
    return [len(groups) for groups in rank_communicators(plan)]

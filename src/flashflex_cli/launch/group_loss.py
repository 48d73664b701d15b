"""Whole replica groups lost in an elastic run (a plan with `outer_sync`, issue 32): the other groups continue.

Replica groups train on their own between outer steps (semantics/outer_sync.py), so a group whose every device was
lost can be left out without re-planning the others: when every lost device belongs to groups lost whole and at
least one group remains, the new plan (`group_loss_plan`) is the old one without those groups. Their pipelines
are removed, the remaining pipelines renumbered in order, and every remaining group keeps its pipelines, stages,
TP degrees, layers, micro-batches and inner steps; `train.global_batch` becomes the sequences the remaining
pipelines train per step (the plan format's rule: the pipelines' batch shares sum to it). The devices keep their
place but take their names in the reduced cluster (a node's remaining devices renumbered from 0, as
launch/elastic.reduced_cluster writes it: `device_renames`). One remaining group is a plan without `outer_sync`:
the synchronous runtime runs it, from the grouped checkpoint (runtime/training/rounds.py). The prediction is made
afresh on the reduced cluster (a round's figures while groups remain, cost/outer_sync.round_predicted).

A relaunch resumes from a checkpoint and runs to --steps, so the new plan's rounds must fit the run
(`RunSteps.fits`): losing the group with the most inner steps shortens the round. A loss that is not of whole
groups, or whose remaining groups do not fit, is re-planned on the reduced cluster as before (launch/elastic.py).

Pure and deterministic: the same plan, lost devices and clusters give the same plan, byte for byte.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..cost.params import CostParams
from ..hardware.cluster import Cluster
from ..plan.schema import PipelinePlan, Plan
from ..semantics.outer_sync import group_inner_steps, group_pipelines


@dataclass(frozen=True)
class RunSteps:
    """What a relaunch must fit: the run's --steps, --checkpoint-every (0: a checkpoint at the end only) and the
    step it resumes from."""

    steps: int
    checkpoint_every: int
    start: int

    def fits(self, plan: Plan) -> bool:
        """True when `plan`'s rounds (its largest inner step count; 1 step without replica groups) divide the
        steps, the checkpoint interval and the resume step."""
        stride = max(group_inner_steps(plan))
        return all(count % stride == 0 for count in (self.steps, self.checkpoint_every, self.start))


@dataclass(frozen=True)
class GroupLoss:
    """The plan after losing whole replica groups, and those groups (indices in the old plan)."""

    plan: Plan
    groups: list[int]


def lost_groups(plan: Plan, lost: Collection[str]) -> list[int] | None:
    """The replica groups of `plan` whose every device is in `lost`, when they hold every lost device the plan uses
    (a lost device it leaves idle does not matter) and at least one group remains; None otherwise (no `outer_sync`,
    nothing used lost, a group lost in part, every group lost)."""
    if plan.outer_sync is None:
        return None
    by_pipeline: dict[int, list[str]] = {}
    for rank in plan.ranks():
        by_pipeline.setdefault(rank.pipeline, []).append(rank.device)
    devices = [[d for p in pipes for d in by_pipeline[p]] for pipes in group_pipelines(plan)]
    gone = set(lost) & {d for group in devices for d in group}
    if not gone:
        return None
    whole = [g for g, group in enumerate(devices) if set(group) <= gone]
    covered = {d for g in whole for d in devices[g]}
    if not whole or len(whole) == len(devices) or covered != gone:
        return None
    return whole


def device_renames(cluster: Cluster, lost: Collection[str]) -> dict[str, str]:
    """Each device of `cluster` not in `lost` -> its name in the cluster without them (a node's remaining devices
    renumbered from 0 in order, as launch/elastic.reduced_cluster writes it)."""
    gone = set(lost)
    renames: dict[str, str] = {}
    for node in cluster.nodes:
        kept = [f"{node.name}/{i}" for i in range(len(node.devices)) if f"{node.name}/{i}" not in gone]
        renames.update({old: f"{node.name}/{new}" for new, old in enumerate(kept)})
    return renames


def without_groups(plan: Plan, groups: Collection[int], renames: dict[str, str], cluster: Cluster) -> Plan:
    """`plan` without replica groups `groups` (module docstring) for `cluster` (the reduced one: its name and
    sha256 recorded), devices renamed by `renames`; no prediction. ValueError when the plan has no replica groups
    or none would remain."""
    if plan.outer_sync is None:
        raise ValueError("the plan has no replica groups (no outer_sync section) to leave out")
    kept = [g for g in range(len(plan.outer_sync.groups)) if g not in set(groups)]
    if not kept:
        raise ValueError("every replica group of the plan would be left out")
    old_groups = plan.outer_sync.groups
    pipelines, new_groups = [], []
    for g in kept:
        first = len(pipelines)
        pipelines += [_renamed(plan.pipelines[p], renames) for p in old_groups[g].pipelines]
        new_groups.append(old_groups[g].model_copy(update={"pipelines": list(range(first, len(pipelines)))}))
    outer = None
    if len(new_groups) > 1:
        why = plan.outer_sync.reason
        note = f"replica group(s) {', '.join(map(str, sorted(groups)))} lost in an elastic run, the others kept"
        outer = plan.outer_sync.model_copy(update={"groups": new_groups,
                                                   "reason": None if why is None else f"{note}; planned: {why}"})
    unused = [u.model_copy(update={"device": renames[u.device]}) for u in plan.unused_devices if u.device in renames]
    train = plan.inputs.train.model_copy(update={"global_batch": sum(pipe.sequences for pipe in pipelines)})
    inputs = plan.inputs.model_copy(update={"train": train, "cluster_sha256": cluster.sha256(),
                                            "cluster_name": cluster.name, "cluster_path": None})
    data = plan.model_dump(mode="json", by_alias=True, exclude_none=True)
    data.update(inputs=inputs.model_dump(mode="json", by_alias=True, exclude_none=True),
                pipelines=[pipe.model_dump(mode="json") for pipe in pipelines],
                unused_devices=[u.model_dump(mode="json") for u in unused])
    data.pop("predicted", None)
    data.pop("outer_sync", None)
    if outer is not None:
        data["outer_sync"] = outer.model_dump(mode="json", exclude_none=True)
    return Plan.model_validate(data)  # validated afresh: the batch, the groups' pipelines, the devices


def _renamed(pipe: PipelinePlan, renames: dict[str, str]) -> PipelinePlan:
    """Pipeline `pipe` with its stages' devices renamed."""
    stages = [stage.model_copy(update={"devices": [renames[d] for d in stage.devices]}) for stage in pipe.stages]
    return pipe.model_copy(update={"stages": stages})


def predicted_plan(plan: Plan, cluster: Cluster, params: CostParams) -> Plan:
    """`plan` predicted afresh on `cluster`: the cost model's step, or a round's figures for replica groups (as
    `flashflex show --cluster` predicts them)."""
    from ..cost.estimate import estimate
    from ..cost.reestimate import reestimated

    found = reestimated(plan, estimate(plan, cluster, params))
    if plan.outer_sync is None:
        return found
    from ..cost.outer_sync import round_predicted
    from ..plan.predicted import Predicted

    return found.model_copy(update={"predicted": Predicted.model_validate(round_predicted(plan, cluster, params))})


def group_loss_plan(plan: Plan, lost: Collection[str], cluster: Cluster, reduced: Cluster,
                    params: CostParams) -> GroupLoss | None:
    """The plan for `reduced` (`cluster` without `lost`) when `lost` are whole replica groups of `plan` and some
    group remains (`lost_groups`), predicted afresh there; None otherwise (the caller re-plans)."""
    groups = lost_groups(plan, lost)
    if groups is None:
        return None
    kept = without_groups(plan, groups, device_renames(cluster, lost), reduced)
    return GroupLoss(predicted_plan(kept, reduced, params), groups)

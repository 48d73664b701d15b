"""Texts of a plan's replica groups and outer synchronisation (`outer_sync`), for `show` and `diff`."""

from __future__ import annotations

from ..semantics.outer_sync import group_sequences, group_weights
from .schema import OuterSync, Plan


def _pipelines_text(pipelines: list[int]) -> str:
    """[0, 1, 2] -> "pipelines 0-2"; [3] -> "pipeline 3"."""
    if len(pipelines) == 1:
        return f"pipeline {pipelines[0]}"
    return f"pipelines {pipelines[0]}-{pipelines[-1]}"


def optimizer_text(outer: OuterSync) -> str:
    """"outer SGD, Nesterov momentum 0.9, lr 0.7"."""
    opt = outer.optimizer
    kind = "Nesterov momentum" if opt.nesterov else "momentum"
    return f"outer SGD, {kind} {opt.momentum:g}, lr {opt.lr:g}"


def schedule_text(outer: OuterSync) -> str:
    """How pseudo-gradients travel: dtype, fragment schedule and overlap."""
    fragments = ("the whole model each round" if outer.fragments == 1
                 else f"{outer.fragments} layer fragments streamed in turn")
    overlap = "" if outer.overlap_steps == 0 else (
        f", each exchange overlapping {outer.overlap_steps} inner step{'s' if outer.overlap_steps != 1 else ''}, "
        f"merged with alpha {outer.merge_alpha:g}")
    return f"pseudo-gradients in {outer.compression}, {fragments}{overlap}"


def outer_sync_lines(plan: Plan) -> list[str]:
    """One line for the outer synchronisation, one per replica group, and the planner's reason (none for a
    plan without `outer_sync`)."""
    outer = plan.outer_sync
    if outer is None:
        return []
    seq_len = plan.inputs.train.seq_len
    out = [f"local sync: {len(outer.groups)} replica group{'s' if len(outer.groups) != 1 else ''} joined by an "
           f"outer step every round; {optimizer_text(outer)}; {schedule_text(outer)}"]
    for g, (group, weight) in enumerate(zip(outer.groups, group_weights(plan), strict=True)):
        out.append(f"  group {g}: {_pipelines_text(group.pipelines)}, {group.inner_steps} inner steps per round of "
                   f"{group_sequences(plan, g) * seq_len:,} tokens, {weight * 100:.1f}% of the round's tokens")
    if outer.reason:
        out.append(f"  why: {outer.reason}")
    return out


def outer_sync_changes(a: Plan, b: Plan) -> list[str]:
    """Structural changes of the outer synchronisation from plan `a` to plan `b`, one line each."""
    oa, ob = a.outer_sync, b.outer_sync
    if oa is None and ob is None:
        return []
    if oa is None or ob is None:
        now = ob or oa
        assert now is not None
        state = f"{len(now.groups)} replica groups" if ob is not None else "synchronous (one group)"
        return [f"sync: {'synchronous' if oa is None else f'{len(oa.groups)} replica groups'} -> {state}"]
    out: list[str] = []
    if len(oa.groups) != len(ob.groups):
        out.append(f"replica groups: {len(oa.groups)} -> {len(ob.groups)}")
    for g in range(min(len(oa.groups), len(ob.groups))):
        ga, gb = oa.groups[g], ob.groups[g]
        if ga.pipelines != gb.pipelines:
            out.append(f"group {g}: {_pipelines_text(ga.pipelines)} -> {_pipelines_text(gb.pipelines)}")
        if ga.inner_steps != gb.inner_steps:
            out.append(f"group {g}: inner steps per round {ga.inner_steps} -> {gb.inner_steps}")
    if oa.optimizer != ob.optimizer:
        out.append(f"outer optimizer: {optimizer_text(oa)} -> {optimizer_text(ob)}")
    if schedule_text(oa) != schedule_text(ob):
        out.append(f"outer sync: {schedule_text(oa)} -> {schedule_text(ob)}")
    return out

"""Hierarchical DP reduction (RuntimeOptions.hierarchical_dp): holders on 3 nodes x 2 devices (all processes on
this host, gloo over loopback) reduce inside each node, across nodes by one leader each, and back; the result
equals the flat reduction and the one-process reference, with overlap on and off.

Tolerances as in tests/test_grad_overlap.py: the hierarchy only reassociates each element's sum over at most
five holders, far inside the fp32 bounds used for the parity tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.parallel.groups import slice_holders
from flashflex_cli.runtime.parallel.hier_reduce import hierarchical_groups, node_of, node_split, node_splits

from .test_grad_overlap import TIED, DPPool, assert_matches_reference, assert_same_runs, dp_pool  # noqa: F401
from .test_parity import make_plan


def on_nodes(plan: Plan, devices: list[str]) -> Plan:
    """`plan` with its devices renamed, in rank order."""
    data = plan.model_dump(mode="json")
    names = iter(devices)
    for pipe in data["pipelines"]:
        for stage in pipe["stages"]:
            stage["devices"] = [next(names) for _ in stage["devices"]]
    return Plan.model_validate(data)


def three_nodes() -> Plan:
    """node0: one TP-2 pipeline; node1: two TP-1 pipelines; node2: one pipeline of two TP-1 stages (a tied
    embedding at both ends). Every holder set of a sharded slice has one holder on node0, two on node1 and one or
    two on node2."""
    plan = make_plan(TIED, [(1, 2, [(2, (0, 4))]), (1, 1, [(1, (0, 4))]), (1, 1, [(1, (0, 4))]),
                            (1, 2, [(1, (0, 2)), (1, (2, 4))])])
    return on_nodes(plan, [f"node{n}/{d}" for n in range(3) for d in range(2)])


def test_node_split_is_pure_and_ordered() -> None:
    plan = three_nodes()
    assert node_of("node1/3") == "node1"
    split = node_split(plan, (5, 0, 3, 2))
    assert split.parts == ((0,), (2, 3), (5,))
    assert split.leaders == (0, 2, 5) and split.hierarchical
    assert split.groups_needed() == [(2, 3), (0, 2, 5)]
    assert not node_split(plan, (0, 2, 4)).hierarchical  # one holder per node: the flat ring is the hierarchy
    assert not node_split(plan, (2, 3)).hierarchical  # one node
    sets = sorted({sl.ranks for sl in slice_holders(plan) if sl.needs_reduce})
    splits = node_splits(plan, sets)
    assert splits and all(s.hierarchical for s in splits.values())
    groups = hierarchical_groups(splits.values())
    assert groups == sorted(set(groups)) and (2, 3) in groups
    # the same plan on one node: nothing hierarchical
    flat = on_nodes(plan, [f"node0/{d}" for d in range(6)])
    assert node_splits(flat, sets) == {}


@pytest.mark.slow
def test_hierarchical_equals_flat_and_reference(tmp_path: Path, dp_pool: DPPool) -> None:  # noqa: F811
    """3 nodes x 2 devices: hierarchical (overlapped and blocking) == flat == one-process reference."""
    plan = three_nodes()
    hier = dp_pool.run_plan(plan, tmp_path, {"overlap_dp": True, "hierarchical_dp": True})
    hier_blocking = dp_pool.run_plan(plan, tmp_path, {"overlap_dp": False, "hierarchical_dp": True})
    flat = dp_pool.run_plan(plan, tmp_path, {"overlap_dp": True, "hierarchical_dp": False})
    for out in hier + hier_blocking:
        assert out["hier_sets"], "every rank holds some slice whose holders span nodes"
        hier_sets = {tuple(m) for m in out["hier_sets"]}
        assert any(tuple(m) in hier_sets for _, m in out["post_log"]), "no bucket took the hierarchical path"
    # the cross-node step is timed on the leaders (the lowest holder per node) only; flat runs have none
    for outs in (hier, hier_blocking):
        for rank, out in enumerate(outs):
            leads = any(rank in node_split(plan, tuple(m)).leaders for m in out["hier_sets"])
            assert (out["timings"]["dp_across"] > 0) == leads
            assert out["timings"]["dp_across"] <= out["timings"]["dp_total"]
    assert all(out["timings"]["dp_across"] == 0 for out in flat)
    assert_matches_reference(plan, hier)
    assert_matches_reference(plan, hier_blocking)
    assert_same_runs(hier, flat, plan)
    assert_same_runs(hier_blocking, flat, plan)

"""NCCL communicator memory, charged per group (semantics/process_groups.py, cost/memory.py): the count per rank
is the number of groups `runtime/groups.build_groups` really creates for it (checked on real gloo groups for
asymmetric plans), and the cost model charges a GPU stage for each by the group's fabric (NVLink inside one node, else fewer channels), a CPU
stage nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashflex_cli.cost.estimate import estimate, plan_memory
from flashflex_cli.cost.memory import communicator_bytes, minimum_communicators
from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.semantics.process_groups import communicators, group_members, rank_communicators
from tests.infra.worker_pool import WorkerPool, gloo_rank

from .test_grad_overlap import TIED, UNLIKE
from .test_hier_reduce import on_nodes, three_nodes
from .test_parity import make_plan

# a TP change at a stage boundary (2 -> 1) beside a pipeline of one TP-2 stage: unlike stage splits
TP_CHANGE = make_plan("llama-tiny", [(1, 2, [(2, (0, 1)), (1, (1, 4))]), (1, 2, [(2, (0, 4))])])
PLANS = {"three-nodes": three_nodes(), "tied-unlike": make_plan(TIED, UNLIKE), "tp-change": TP_CHANGE}


def groups_job(rank: int, world: int, init_file: str, out_dir: str, plan_json: str) -> None:
    """Build the plan's groups; save the members of every non-default group this rank belongs to."""
    with gloo_rank(rank, world, init_file):
        groups = build_groups(Plan.model_validate_json(plan_json), rank)
        sizes = [dist.get_world_size(g) for g in groups.member_groups()]
        members = sorted([*groups.dp_groups, *groups.node_groups])
        torch.save({"sizes": sizes, "keyed": members, "tp": groups.tp_group is not None},
                   Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(6, groups_job) as workers:
        yield workers


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_count_is_what_build_groups_creates(name: str, tmp_path: Path, pool: WorkerPool) -> None:
    plan = PLANS[name]
    pool.run([(rank, plan.world_size, str(tmp_path / "store"), str(tmp_path), plan.to_json())
              for rank in range(plan.world_size)], 300.0)
    counts = communicators(plan)
    for rank in range(plan.world_size):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        # the default group, plus every group of two or more ranks this rank is a member of
        assert counts[rank] == 1 + sum(size > 1 for size in got["sizes"]), (name, rank, got)
        wanted = sorted(g.members for g in group_members(plan) if rank in g.members and g.role in ("dp",
                                                                                                  "hierarchical"))
        assert got["keyed"] == wanted


def test_counts_of_a_plan_worked_by_hand() -> None:
    # two single-stage TP-1 pipelines: default, world, one DP group (every parameter held by both)
    plan = make_plan("llama-tiny", [(1, 1, [(1, (0, 4))]), (1, 1, [(1, (0, 4))])])
    assert communicators(plan) == [3, 3]
    # one rank: no communicator with a peer
    assert communicators(make_plan("llama-tiny", [(1, 1, [(1, (0, 4))])])) == [0]
    # one pipeline, TP 2 then TP 1, untied: default, world, TP (ranks 0, 1); no parameter is held twice
    assert communicators(make_plan("llama-tiny", [(1, 2, [(2, (0, 2)), (1, (2, 4))])])) == [3, 3, 2]
    assert minimum_communicators(2, 3) == 3 and minimum_communicators(1, 1) == 0


def test_gpu_stages_are_charged_per_communicator_by_its_fabric_cpu_stages_are_not() -> None:
    params = CostParams()
    nvlink, other = (params.nccl_channels_nvlink * params.nccl_channel_bytes,
                     params.nccl_channels_other * params.nccl_channel_bytes)
    # one node of NVLink GPUs: every communicator inside it runs NVLink's channels
    one_node = build_cluster("1x8xA100-80G-SXM:nic=ib")
    plan = on_nodes(TP_CHANGE, one_node.device_ids[:5])
    memory = plan_memory(plan, one_node, params)
    for info in plan.ranks():
        mem = memory[(info.pipeline, info.stage)]
        assert mem.reserve >= params.memory_reserve_bytes + communicators(plan)[info.rank] * nvlink - 1.0
    stage_ranks_counts = {}
    for info in plan.ranks():
        key = (info.pipeline, info.stage)
        stage_ranks_counts[key] = max(stage_ranks_counts.get(key, 0), communicators(plan)[info.rank])
    assert {key: mem.reserve for key, mem in memory.items()} == pytest.approx(
        {key: params.memory_reserve_bytes + count * nvlink for key, count in stage_ranks_counts.items()})
    # three nodes: a group within a node keeps NVLink's channels, one across nodes runs the other count
    nodes = build_cluster("3x2xA100-80G-SXM:nic=ib")
    spread = on_nodes(TP_CHANGE, nodes.device_ids[:5])  # TP (0, 1) on node0; DP sets and the world span nodes
    rank_groups = rank_communicators(spread)
    devices = [info.device for info in spread.ranks()]
    want = [sum(nvlink if len({devices[r].split("/")[0] for r in members}) == 1 else other for members in groups)
            for groups in rank_groups]
    got = plan_memory(spread, nodes, params)
    for info in spread.ranks():
        assert got[(info.pipeline, info.stage)].reserve >= params.memory_reserve_bytes + want[info.rank] - 1.0
    assert communicator_bytes(nodes, "node0/0", params) == pytest.approx(nvlink)
    assert communicator_bytes(build_cluster("1x2xA100-80G-PCIe"), "node0/0", params) == pytest.approx(other)
    est = estimate(spread, nodes, params)
    assert [st.memory.reserve for st in est.stages] == [got[(st.pipeline, st.stage)].reserve for st in est.stages]
    cpu = build_cluster("3x2xcpu")
    assert all(mem.reserve == params.cpu_memory_reserve_bytes for mem in plan_memory(spread, cpu, params).values())

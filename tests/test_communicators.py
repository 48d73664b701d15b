"""NCCL communicator memory, charged per group (semantics/process_groups.py, cost/memory.py): the count per rank
is the number of groups `runtime/groups.build_groups` really creates for it (checked on real gloo groups for
asymmetric plans), and the cost model charges a GPU stage `communicator_bytes` for each (by its fabric), a CPU one nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashflex_cli.cost.estimate import estimate, plan_memory, stage_communicators
from flashflex_cli.cost.memory import communicator_bytes, minimum_communicators
from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.groups import build_groups
from flashflex_cli.semantics.process_groups import communicators, group_members
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


def test_gpu_stages_are_charged_per_communicator_cpu_stages_are_not() -> None:
    params = CostParams()
    # 5 ranks on a cluster of three nodes of two GPUs
    gpu = build_cluster("3x2xA100-80G-SXM:nic=ib")
    plan = on_nodes(TP_CHANGE, gpu.device_ids[:5])
    counts = stage_communicators(plan)
    per_communicator = communicator_bytes(gpu, "node0/0", params)
    assert per_communicator == params.nccl_channels_nvlink * params.nccl_channel_bytes  # SXM: NVLink
    assert communicator_bytes(build_cluster("1x2xA100-80G-PCIe"), "node0/0", params) == pytest.approx(
        params.nccl_channels_other * params.nccl_channel_bytes)
    memory = plan_memory(plan, gpu, params)
    for key, mem in memory.items():
        assert counts[key] >= 2
        assert mem.reserve == pytest.approx(params.memory_reserve_bytes + counts[key] * per_communicator)
    est = estimate(plan, gpu, params)
    assert [st.memory.reserve for st in est.stages] == [memory[(st.pipeline, st.stage)].reserve for st in est.stages]
    cpu = build_cluster("3x2xcpu")
    assert all(mem.reserve == params.cpu_memory_reserve_bytes for mem in plan_memory(plan, cpu, params).values())

"""Multi-rank runs on NCCL and CUDA (marker `cuda`): where the machine has the GPUs, the runtime's NCCL paths
equal the one-process reference as its gloo paths do (tests/test_parity.py, tests/test_grad_overlap.py);
elsewhere every test here skips. benchmarks/gpu_session.sh `multigpu` runs them on a machine with 2+ GPUs.

- two ranks on two GPUs: a pipeline of two stages holding both ends of a tied embedding with the overlapped DP
  reduction (its bucket reduced after the schedule: the hang issue 28 describes), and two single-stage pipelines
  in DP, and one TP-2 stage;
- two ranks on one GPU as separate NCCL hosts (NCCL_HOSTID per rank, sockets on loopback: `launch --share-gpu`).

Tolerances: fp32 plans compute in fp32 on CUDA (no TF32), so the only differences from the CPU reference are
the order of sums (cuBLAS and NCCL against CPU kernels and gloo), ~1e-6 relative per step over the few thousand
tokens here: 1e-4 relative on losses and gradient norms leaves a factor of 100.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.reference import reference_train
from flashflex_cli.semantics.runtime_paths import RuntimeOptions

from .test_grad_overlap import TIED
from .test_parity import OPTIM, SEED, make_batches, make_plan

STEPS = 3
RTOL = 1e-4
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.cuda, pytest.mark.slow]

PLANS = {
    "tied-two-stages": make_plan(TIED, [(1, 4, [(1, (0, 2)), (1, (2, 4))])]),
    "two-pipelines": make_plan(TIED, [(1, 2, [(1, (0, 4))]), (2, 1, [(1, (0, 4))])]),
    "tp2": make_plan("llama-tiny", [(1, 4, [(2, (0, 4))])]),
}


def _nccl_rank(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, share: bool) -> None:
    """One rank: NCCL on its own GPU (or cuda:0 as its own NCCL host), STEPS steps, results saved."""
    if share:
        os.environ.update({"NCCL_HOSTID": f"flashflex-test-rank-{rank}", "NCCL_P2P_DISABLE": "1",
                           "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"})
    device = torch.device("cuda", 0 if share else rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120), device_id=device)
    try:
        plan = Plan.model_validate_json(plan_json)
        engine = RankEngine(plan, rank, build_groups(plan, rank), device, OPTIM, seed=SEED,
                            options=RuntimeOptions(compile=False))
        batches = make_batches(plan, steps=STEPS)
        results = []
        for step in range(STEPS):
            result = engine.train_step(batches[step][engine.pipeline_slice(plan.inputs.train.global_batch)])
            results.append((result.loss, result.grad_norm))
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run(plan: Plan, tmp_path: Path, share: bool) -> list[list[tuple[float, float]]]:
    mp.spawn(_nccl_rank, args=(plan.world_size, plan.to_json(), str(tmp_path / "store"), str(tmp_path), share),
             nprocs=plan.world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(plan.world_size)]


def _assert_reference(plan: Plan, runs: list[list[tuple[float, float]]]) -> None:
    ref = reference_train(plan.inputs.model, make_batches(plan, steps=STEPS), OPTIM, seed=SEED)
    for rank, results in enumerate(runs):
        for step, (loss, norm) in enumerate(results):
            assert loss == pytest.approx(ref.losses[step], rel=RTOL), (rank, step)
            assert norm == pytest.approx(ref.grad_norms[step], rel=RTOL), (rank, step)


@pytest.mark.skipif(GPUS < 2, reason="needs two or more CUDA devices")
@pytest.mark.parametrize("name", sorted(PLANS))
def test_two_gpus_equal_the_reference(name: str, tmp_path: Path) -> None:
    plan = PLANS[name]
    _assert_reference(plan, _run(plan, tmp_path, share=False))


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device")
def test_two_nccl_hosts_on_one_gpu_equal_the_reference(tmp_path: Path) -> None:
    plan = PLANS["tied-two-stages"]
    _assert_reference(plan, _run(plan, tmp_path, share=True))

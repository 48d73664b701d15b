"""The overlapped DP reduction issues its collectives the way NCCL needs them (runtime/parallel/grad_sync.py,
runtime/parallel/collective_chain.py), checked with real multi-process gloo runs:

- every DP collective (flat buckets and each step of a hierarchical chain) is issued with `async_op=True` from
  the thread that runs the training step, never blocking from a helper thread (on NCCL a blocking call there
  makes the default stream wait on every bucket: the issue-28 hazard);
- a tied embedding's buckets are issued only after the pipeline schedule (a 2-stage pipeline holding both
  ends), and the run equals the blocking schedule and the one-process reference;
- hierarchical chains, whose later steps go out when the hooks find the earlier ones complete, keep one
  collective order per group when one rank is three times slower than the others (other polling outcomes on
  every rank): the run still equals the reference.

Tolerances: those of tests/test_grad_overlap.py (fp32; each element summed over at most six holders).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.semantics.buckets import KEY_EMBED
from flashflex_cli.semantics.runtime_paths import RuntimeOptions
from tests.infra.worker_pool import WorkerPool, gloo_rank

from .test_grad_overlap import STEPS, TIED, UNLIKE, assert_matches_reference, assert_same_runs
from .test_hier_reduce import three_nodes
from .test_parity import OPTIM, SEED, make_batches, make_plan

_WATCHED = ("all_reduce", "reduce", "broadcast")


def _watch_dp_calls(dp_groups: set[Any], calls: list[tuple[str, bool, bool]]) -> dict[str, Any]:
    """Wrap torch.distributed's all_reduce, reduce and broadcast so every call on a group in `dp_groups` appends
    (name, async_op, called from this thread) to `calls`; returns the originals."""
    originals = {name: getattr(dist, name) for name in _WATCHED}
    main = threading.get_ident()

    def wrap(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("group") in dp_groups:
                calls.append((name, bool(kwargs.get("async_op", False)), threading.get_ident() == main))
            return originals[name](*args, **kwargs)
        return call

    for name in _WATCHED:
        setattr(dist, name, wrap(name))
    return originals


def async_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, options: dict[str, bool],
              slow_rank: int) -> None:
    """Train STEPS steps with `options` (`slow_rank` three times slower); save losses, norms, first-step
    gradients, the last step's post log and the DP collectives' calls."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        groups = build_groups(plan, rank)
        engine = RankEngine(plan, rank, groups, torch.device("cpu"), OPTIM, seed=SEED,
                            slowdown=3.0 if rank == slow_rank else 1.0,
                            options=RuntimeOptions(lean_p2p=False, **options))
        calls: list[tuple[str, bool, bool]] = []
        originals = _watch_dp_calls({*groups.dp_groups.values(), *groups.node_groups.values()}, calls)
        try:
            batches = make_batches(plan, steps=STEPS)
            results, grads = [], {}
            for step in range(STEPS):
                result = engine.train_step(batches[step][engine.pipeline_slice(plan.inputs.train.global_batch)])
                results.append((result.loss, result.grad_norm))
                if step == 0:
                    grads = engine.gather_full_grads()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        torch.save({"results": results, "grads": grads, "post_log": engine.sync.post_log,
                    "early": engine.sync.posted_in_backward, "calls": calls,
                    "timings": result.timings}, Path(out_dir) / f"rank{rank}.pt")


class AsyncPool(WorkerPool):
    """`size` reusable processes running `async_job`."""

    def __init__(self, size: int) -> None:
        super().__init__(size, async_job)

    def run_plan(self, plan: Plan, tmp_path: Path, options: dict[str, bool], slow_rank: int = -1
                 ) -> list[dict[str, Any]]:
        out = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
        out.mkdir()
        self.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out), options, slow_rank)
                  for rank in range(plan.world_size)], 240.0)
        return [torch.load(out / f"rank{r}.pt") for r in range(plan.world_size)]


@pytest.fixture(scope="module")
def async_pool() -> Iterator[AsyncPool]:
    with AsyncPool(6) as pool:
        yield pool


@pytest.mark.slow
def test_tied_embedding_buckets_wait_for_the_schedule_and_every_collective_is_async(
        tmp_path: Path, async_pool: AsyncPool) -> None:
    """Two unlike pipelines, one of two stages holding both ends of a tied embedding: with overlap every DP
    collective is async from the training thread, the embedding's buckets come after every bucket issued inside
    the schedule, and the run equals the blocking schedule and the reference."""
    plan = make_plan(TIED, UNLIKE)
    on = async_pool.run_plan(plan, tmp_path, {"overlap_dp": True, "hierarchical_dp": False})
    off = async_pool.run_plan(plan, tmp_path, {"overlap_dp": False, "hierarchical_dp": False})
    assert_matches_reference(plan, on)
    assert_same_runs(on, off, plan)
    for rank, out in enumerate(on + off):
        assert out["calls"], f"rank {rank} issued no DP collective"
        assert all(is_async and here for _, is_async, here in out["calls"]), (rank, out["calls"])
    for rank, out in enumerate(on):
        tied_at = [i for i, (key, _) in enumerate(out["post_log"]) if key == KEY_EMBED]
        assert tied_at, f"rank {rank} holds the tied embedding but reduced no bucket of it"
        assert min(tied_at) >= out["early"], f"rank {rank} reduced the tied embedding inside the schedule"
        assert out["early"] >= 1, f"rank {rank}: nothing was reduced during the backward"


@pytest.mark.slow
def test_hierarchical_chains_keep_one_order_with_a_slow_rank(tmp_path: Path, async_pool: AsyncPool) -> None:
    """3 nodes x 2 devices, hierarchical and overlapped, rank 3 (a node leader's partner) three times slower:
    every chain step is async from the training thread and the run equals the one-process reference."""
    plan = three_nodes()
    runs = async_pool.run_plan(plan, tmp_path, {"overlap_dp": True, "hierarchical_dp": True}, slow_rank=3)
    assert_matches_reference(plan, runs)
    for rank, out in enumerate(runs):
        assert all(is_async and here for _, is_async, here in out["calls"]), (rank, out["calls"])
    assert any(name == "reduce" for out in runs for name, _, _ in out["calls"]), "no chain took the hierarchical path"
    assert any(out["timings"]["dp_across"] > 0 for out in runs)
    assert all(out["timings"]["dp_across"] <= out["timings"]["dp_total"] for out in runs)

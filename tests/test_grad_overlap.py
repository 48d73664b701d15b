"""Gradient reduction overlapped with the backward (RuntimeOptions.overlap_dp): real multi-process gloo runs of
plans with unlike pipelines (other stage splits and TP degrees, a tied embedding) with overlap on, off, and the
one-process reference; the bucket post order is the same global order on every rank; a dropped engine is freed.

Tolerances: those of tests/test_parity.py (fp32, sums over at most a few thousand tokens): 1e-5 relative for
losses and norms, `grad_atol` for gradient elements that nearly cancel. Overlap on and off reduce the same
values in other buckets, i.e. other packings of the same per-element sums: each element is summed over the same
holders in the same order (gloo's all-reduce of one element does not depend on the buffer's length for these
sizes), so they agree within the same bounds.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.parallel.grad_buckets import overlap_buckets, rank_buckets
from flashflex_cli.runtime.parallel.groups import build_groups, slice_holders
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.reference import reference_train
from flashflex_cli.semantics.buckets import backward_key
from flashflex_cli.semantics.runtime_paths import RuntimeOptions
from tests.infra.worker_pool import WorkerPool, gloo_rank

from .test_parity import OPTIM, RTOL, SEED, _assert_close, grad_atol, make_batches, make_plan

STEPS = 2
TIED = PRESETS["llama-tiny"].model_copy(update={"name": "tiny-tied", "tie_embeddings": True})


def dp_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, options: dict[str, bool]) -> None:
    """Train STEPS steps of the plan on `rank` with `options`; save losses, norms, first-step full gradients,
    the DP bucket post log and timings of the last step."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        groups = build_groups(plan, rank)
        engine = RankEngine(plan, rank, groups, torch.device("cpu"), OPTIM, seed=SEED,
                            options=RuntimeOptions(lean_p2p=False, **options))
        batches = make_batches(plan, steps=STEPS)
        results, grads, timings = [], {}, {}
        for step in range(STEPS):
            result = engine.train_step(batches[step][engine.pipeline_slice(plan.inputs.train.global_batch)])
            results.append((result.loss, result.grad_norm))
            timings = result.timings
            if step == 0:
                grads = engine.gather_full_grads()
        outputs = {"results": results, "grads": grads, "post_log": engine.sync.post_log,
                   "early": engine.sync.posted_in_backward, "timings": timings,
                   "hier_sets": sorted(engine.groups.node_splits)}
        engine.sync.close()
        sync = weakref.ref(engine.sync)
        del engine
        gc.collect()
        outputs["sync_freed"] = sync() is None  # nothing outside the engine (the gradient hooks) keeps it
        torch.save(outputs, Path(out_dir) / f"rank{rank}.pt")


class DPPool(WorkerPool):
    """`size` reusable processes running `dp_job`."""

    def __init__(self, size: int) -> None:
        super().__init__(size, dp_job)

    def run_plan(self, plan: Plan, tmp_path: Path, options: dict[str, bool], timeout_s: float = 240.0
                 ) -> list[dict[str, Any]]:
        """Run `plan` with `options` on plan.world_size processes; every rank's saved outputs."""
        out = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
        out.mkdir()
        self.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out), options)
                  for rank in range(plan.world_size)], timeout_s)
        return [torch.load(out / f"rank{r}.pt") for r in range(plan.world_size)]


@pytest.fixture(scope="module")
def dp_pool() -> Iterator[DPPool]:
    """Six reusable worker processes."""
    with DPPool(6) as pool:
        yield pool


def assert_matches_reference(plan: Plan, outputs: list[dict[str, Any]]) -> None:
    """Losses and norms of every step and first-step gradients of every rank equal the one-process run."""
    ref = reference_train(plan.inputs.model, make_batches(plan, steps=STEPS), OPTIM, seed=SEED)
    seen: set[str] = set()
    for rank, out in enumerate(outputs):
        got = torch.tensor(out["results"], dtype=torch.float64)
        _assert_close(f"rank {rank} losses", got[:, 0], torch.tensor(ref.losses[:STEPS], dtype=torch.float64),
                      RTOL, 0.0)
        _assert_close(f"rank {rank} norms", got[:, 1],
                      torch.tensor(ref.grad_norms[:STEPS], dtype=torch.float64), RTOL, 0.0)
        for name, grad in out["grads"].items():
            want = ref.grads[0][name]
            _assert_close(f"rank {rank} grad {name}", grad, want, RTOL,
                          grad_atol(want, plan.inputs.train.tokens_per_step))
            seen.add(name)
    assert seen == set(ref.grads[0])


def assert_same_runs(a: list[dict[str, Any]], b: list[dict[str, Any]], plan: Plan) -> None:
    """Two runs of one plan (other DP schedules) agree rank by rank."""
    for rank, (x, y) in enumerate(zip(a, b, strict=True)):
        _assert_close(f"rank {rank} loss/norm", torch.tensor(x["results"], dtype=torch.float64),
                      torch.tensor(y["results"], dtype=torch.float64), RTOL, 0.0)
        for name, grad in x["grads"].items():
            _assert_close(f"rank {rank} grad {name}", grad, y["grads"][name], RTOL,
                          grad_atol(y["grads"][name], plan.inputs.train.tokens_per_step))


def _expected_order(plan: Plan, rank: int) -> list[tuple[int, tuple[int, ...]]]:
    return [(b.key, b.ranks) for b in rank_buckets(overlap_buckets(slice_holders(plan)), rank)]


# Two unlike pipelines with a tied embedding: TP 2 -> TP 1 stages against TP 1 -> TP 1 with another split.
UNLIKE = [(1, 2, [(2, (0, 2)), (1, (2, 4))]), (1, 3, [(1, (0, 1)), (1, (1, 4))])]


@pytest.mark.slow
def test_overlap_on_off_and_reference_agree(tmp_path: Path, dp_pool: DPPool) -> None:
    """Unlike pipelines (stage splits 2+2 / 1+3, TP 2 and 1), tied embedding: overlap on == off == reference;
    with overlap, buckets are handed over inside the backward and in the global order on every rank."""
    plan = make_plan(TIED, UNLIKE)
    on = dp_pool.run_plan(plan, tmp_path, {"overlap_dp": True, "hierarchical_dp": False})
    off = dp_pool.run_plan(plan, tmp_path, {"overlap_dp": False, "hierarchical_dp": False})
    assert_matches_reference(plan, on)
    assert_matches_reference(plan, off)
    assert_same_runs(on, off, plan)
    for rank, out in enumerate(on):
        assert out["post_log"] == _expected_order(plan, rank), f"rank {rank} posted out of the global order"
        keys = [key for key, _ in out["post_log"]]
        assert keys == sorted(keys, reverse=True)
        assert keys[-1] == backward_key("embed")  # the tied embedding comes last
        # every stage here holds 2+ layers or the last layer: some bucket left inside the backward
        assert out["early"] >= 1, f"rank {rank}: nothing was reduced during the backward"
        assert out["timings"]["dp_total"] >= 0.0 and out["timings"]["dp_sync"] >= 0.0
    # a dropped engine is freed, its process groups (and their gloo threads) with it
    assert all(out["sync_freed"] for out in on + off)
    for out in off:  # blocking: one bucket per holder set, sorted
        assert [members for _, members in out["post_log"]] == sorted(members for _, members in out["post_log"])


@pytest.mark.slow
def test_overlap_single_stage_pipelines_with_unequal_micro_batches(tmp_path: Path, dp_pool: DPPool) -> None:
    """Three pipelines with 1, 2 and 3 micro-batches (each parameter is final after its own pipeline's count):
    overlap on equals the reference."""
    plan = make_plan("llama-tiny", [(2, 1, [(1, (0, 4))]), (1, 2, [(2, (0, 4))]), (1, 3, [(1, (0, 2)), (1, (2, 4))])])
    on = dp_pool.run_plan(plan, tmp_path, {"overlap_dp": True, "hierarchical_dp": False})
    assert_matches_reference(plan, on)
    for rank, out in enumerate(on):
        assert out["post_log"] == _expected_order(plan, rank)


def test_post_order_is_one_global_order() -> None:
    """Pure: every rank's buckets are a subsequence of one global list sorted by (descending layer, holders);
    so any two ranks meet their shared buckets in the same order."""
    plan = make_plan(TIED, UNLIKE + [(2, 1, [(1, (0, 3)), (2, (3, 4))])])
    everything = overlap_buckets(slice_holders(plan))
    assert [(-b.key, b.ranks) for b in everything] == sorted((-b.key, b.ranks) for b in everything)
    orders = [_expected_order(plan, r) for r in range(plan.world_size)]
    for a in range(plan.world_size):
        for b in range(a + 1, plan.world_size):
            shared_a = [x for x in orders[a] if x in orders[b]]
            shared_b = [x for x in orders[b] if x in orders[a]]
            assert shared_a == shared_b
    # head/norm first, layers descending, embedding last
    keys = [b.key for b in everything]
    assert keys[0] == backward_key("norm") and keys[-1] == backward_key("embed")

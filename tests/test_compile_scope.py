"""The compile scope (RuntimeOptions.compile_scope, runtime/model/compiled.py): a TP-1 stage compiled whole as one
graph, per block elsewhere, by the rule `semantics.runtime_paths.stage_compile_scope` states; on CPU with torch's
"aot_eager" backend (inductor's input graphs, run eagerly: cheap, and what inductor would be given).

- The rule: "auto" is "stage" at TP 1 up to STAGE_GRAPH_MAX_LAYERS layers, "block" deeper and at TP > 1; an
  explicit "stage" compiles a TP > 1 stage whole too; old records read "block".
- One rank, the whole stage (embedding, 4 layers, final norm, chunked loss) one graph, made in the warm-up: the
  steps compile nothing and train as the eager engine does.
- An asymmetric plan (pipeline 0: a TP-1 stage then a TP-2 stage; pipeline 1: one TP-1 stage), compiled under
  "auto" (stage, block, stage), against the same plan eager: losses, gradients and parameters within the
  tolerances of tests/test_compile.py (fused fp32 element-wise work and reductions, reordered); and under an
  explicit "stage" (the TP-2 stage whole, its all-reduces traced as functional collectives) the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.model.compiled import is_compiled
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.semantics.runtime_paths import (
    LEGACY,
    STAGE_GRAPH_MAX_LAYERS,
    RuntimeOptions,
    from_record,
    stage_compile_scope,
)
from tests.infra.worker_pool import WorkerPool, gloo_rank
from tests.test_compile import CountingBackend, _run
from tests.test_parity import (
    OPTIM,
    RTOL,
    SEED,
    STEPS,
    _assert_close,
    _assert_params,
    grad_atol,
    make_batches,
    make_plan,
)


def test_the_rule_and_the_record() -> None:
    assert stage_compile_scope("auto", 1, 16) == "stage"
    assert stage_compile_scope("auto", 1, STAGE_GRAPH_MAX_LAYERS + 1) == "block"
    assert stage_compile_scope("auto", 2, 4) == "block" and stage_compile_scope("stage", 2, 4) == "stage"
    assert stage_compile_scope("stage", 1, 80) == "stage" and stage_compile_scope("block", 1, 4) == "block"
    assert LEGACY["compile_scope"] == "block" and from_record({}, "bf16", True).options.compile_scope == "block"
    record = RuntimeOptions(compile_scope="stage").resolved(True).to_record("bf16")
    assert from_record(record, "bf16", True).options.compile_scope == "stage"
    with pytest.raises(ValueError, match="compile_scope"):
        RuntimeOptions(compile_scope="layer")  # type: ignore[arg-type]


def test_one_rank_stage_is_one_graph_made_in_the_warm_up(world_of_one: None) -> None:
    torch._dynamo.reset()
    plan = make_plan("llama-tiny", [(2, 2, [(1, (0, 4))])])
    backend = CountingBackend()
    engine = RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), OPTIM, seed=SEED,
                        options=RuntimeOptions(compile=True), compile_backend=backend)
    eager = RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), OPTIM, seed=SEED)
    assert engine.options.compile_scope == "stage" and engine.module.runners.whole is not None
    assert is_compiled(engine.module) and engine.compile_seconds is not None
    assert len(backend.graphs) == 1  # embedding, layers, norm and loss: one graph (its backward beside it)
    for batch in make_batches(plan, steps=2):
        got, want = engine.train_step(batch), eager.train_step(batch)
        assert got.loss == pytest.approx(want.loss, rel=RTOL)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=RTOL)
    assert len(backend.graphs) == 1


def _rank_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, compiled: bool,
              scope: str = "auto") -> None:
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        backend = CountingBackend()
        engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OPTIM, seed=SEED,
                            options=RuntimeOptions(compile=compiled, compile_scope=scope),  # type: ignore[arg-type]
                            compile_backend=backend)
        warm_graphs = len(backend.graphs)
        results, grads = [], {}
        for step, batch in enumerate(make_batches(plan)):
            result = engine.train_step(batch[engine.pipeline_slice(plan.inputs.train.global_batch)])
            results.append((result.loss, result.grad_norm))
            if step == 0:
                grads = engine.gather_full_grads()
        torch.save({"results": results, "grads": grads, "params": engine.gather_full_params(),
                    "scope": engine.options.compile_scope, "compiled": is_compiled(engine.module),
                    "graphs": (warm_graphs, len(backend.graphs))}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(4, _rank_job) as workers:
        yield workers


@pytest.mark.slow
def test_asymmetric_plan_auto_scope_equals_eager(tmp_path: Path, pool: WorkerPool) -> None:
    plan = make_plan("llama-tiny", [(1, 2, [(1, (0, 2)), (2, (2, 4))]), (2, 1, [(1, (0, 4))])])
    compiled, eager = _run(plan, True, tmp_path, pool), _run(plan, False, tmp_path, pool)
    assert [o["scope"] for o in compiled] == ["stage", "block", "block", "stage"]
    assert all(o["compiled"] for o in compiled) and not any(o["compiled"] for o in eager)
    _assert_runs_equal(plan, compiled, eager)
    assert len(compiled[0]["results"]) == STEPS


@pytest.mark.slow
def test_tp2_stage_compiled_whole_traces_its_all_reduces_and_equals_eager(tmp_path: Path, pool: WorkerPool) -> None:
    """`--compile-scope stage` on the same plan: the TP-2 stage (layers 2-3, vocabulary-parallel chunked loss)
    compiled whole, its layers' all-reduces traced as functional collectives (no graph break at them: fewer graphs
    than per block); the warm-up made every graph (the steps compile nothing), and losses, gradients and
    parameters are the eager run's within the same tolerances."""
    plan = make_plan("llama-tiny", [(1, 2, [(1, (0, 2)), (2, (2, 4))]), (2, 1, [(1, (0, 4))])])
    whole, per_block, eager = (_run_scope(plan, True, "stage", tmp_path, pool),
                               _run_scope(plan, True, "block", tmp_path, pool),
                               _run_scope(plan, False, "auto", tmp_path, pool))
    assert [o["scope"] for o in whole] == ["stage"] * 4 and all(o["compiled"] for o in whole)
    for rank in (1, 2):  # the TP-2 stage's two ranks
        made, total = whole[rank]["graphs"]
        assert made == total  # every graph made in the warm-up, none by a step
        assert total < per_block[rank]["graphs"][1]  # not broken at each of the layers' all-reduces
    _assert_runs_equal(plan, whole, eager)


def _assert_runs_equal(plan: Plan, runs: list[dict], eager: list[dict]) -> None:
    """Every rank's losses and gradient norms, step-0 gradients and final parameters against the eager run's."""
    tokens = plan.inputs.train.tokens_per_step
    for rank, (got, want) in enumerate(zip(runs, eager, strict=True)):
        for index in (0, 1):
            _assert_close(f"rank {rank} results[{index}]", torch.tensor([r[index] for r in got["results"]]),
                          torch.tensor([r[index] for r in want["results"]]), RTOL, 0.0)
        for name, grad in got["grads"].items():
            _assert_close(f"rank {rank} grad {name}", grad, want["grads"][name], RTOL,
                          grad_atol(want["grads"][name], tokens))
            _assert_params(f"rank {rank} param {name}", got["params"][name], want["params"][name])


def _run_scope(plan: Plan, compiled: bool, scope: str, tmp_path: Path, pool: WorkerPool) -> list[dict]:
    out = tmp_path / f"run-{compiled}-{scope}"
    out.mkdir()
    pool.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out), compiled, scope)
              for rank in range(plan.world_size)])
    return [torch.load(out / f"rank{r}.pt") for r in range(plan.world_size)]

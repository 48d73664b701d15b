"""torch.compile in the runtime (runtime/model/compiled.py), on CPU: one graph shared by every layer, parameter names
untouched, compilation done in the warm-up before step 0 (no step compiles anything), a failing compiler falls
back to eager with one warning line, and an asymmetric plan with a TP change at a stage boundary, compiled with
inductor, equals the same plan eager and one-device training.

Kept few and tiny (inductor compiles C++ on the CPU: tens of seconds per graph on a cold cache); the
single-process checks use torch's cheap "aot_eager" backend, which traces and splits forward and backward exactly
as inductor's input is, and runs them eagerly.

Tolerances: compiled kernels fuse and reorder fp32 element-wise work and reductions (RMSNorm's mean, softmax
sums), so compiled and eager agree to fp32 rounding, not bit for bit: the losses within 1e-5 relative, gradients
within `grad_atol` and parameters within `_assert_params` of tests/test_parity.py (the bounds its parity checks
justify for other summation orders).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.model.compiled import compile_stage, is_compiled
from flashflex_cli.runtime.model.stage import StageModule
from flashflex_cli.runtime.model.tensor_parallel import TPContext
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.reference import reference_train
from flashflex_cli.semantics.runtime_paths import RuntimeOptions
from tests.infra.worker_pool import WorkerPool, gloo_rank
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

TINY = PRESETS["llama-tiny"]


class CountingBackend:
    """A torch.compile backend that records each graph it is given and hands it to "aot_eager"."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs.append(gm)
        return aot_eager(gm, example_inputs)


def failing_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    raise RuntimeError("no compiler here")


@pytest.fixture
def one_rank(world_of_one: None) -> Plan:
    """A one-device plan (2 micro-batches of 2 sequences) with torch.distributed initialised for it."""
    return make_plan("llama-tiny", [(2, 2, [(1, (0, 4))])])


def test_every_layer_shares_one_graph_and_names_stay() -> None:
    torch._dynamo.reset()
    module = StageModule(TINY, (0, 4), False, False, TPContext(group=None))
    names = [name for name, _ in module.named_parameters()]
    keys = list(module.state_dict())
    backend = CountingBackend()
    compile_stage(module, backend)
    assert is_compiled(module)
    x = torch.randn(2, 9, TINY.hidden_size, requires_grad=True)
    module(x).sum().backward()
    assert len(backend.graphs) == 1  # four layers, one graph: compile time does not grow with depth
    assert [name for name, _ in module.named_parameters()] == names and list(module.state_dict()) == keys
    assert all(p.grad is not None for p in module.parameters())


def test_compilation_happens_in_the_warm_up_before_step_0(one_rank: Plan) -> None:
    """All graphs (layers, final norm, loss chunks; forward and backward) are compiled when the engine is built;
    the steps compile nothing, and train like the eager engine."""
    torch._dynamo.reset()
    backend = CountingBackend()
    engine = RankEngine(one_rank, 0, build_groups(one_rank, 0), torch.device("cpu"), OPTIM, seed=SEED,
                        options=RuntimeOptions(compile=True, compile_scope="block"), compile_backend=backend)
    eager = RankEngine(one_rank, 0, build_groups(one_rank, 0), torch.device("cpu"), OPTIM, seed=SEED)
    assert engine.options.compile is True and eager.options.compile is False and is_compiled(engine.module)
    assert engine.compile_seconds is not None and engine.compile_seconds > 0 and eager.compile_seconds is None
    compiled_at_start = len(backend.graphs)
    assert compiled_at_start >= 3  # layers, norm, the loss chunk
    assert all(p.grad is None for p in engine.module.parameters())  # the warm-up's gradients are dropped
    for batch in make_batches(one_rank, steps=2):
        got, want = engine.train_step(batch), eager.train_step(batch)
        assert got.loss == pytest.approx(want.loss, rel=RTOL)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=RTOL)
    assert len(backend.graphs) == compiled_at_start


def test_a_failing_compiler_falls_back_to_eager_with_one_warning(one_rank: Plan,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="flashflex.runtime"):
        engine = RankEngine(one_rank, 0, build_groups(one_rank, 0), torch.device("cpu"), OPTIM, seed=SEED,
                            options=RuntimeOptions(compile=True), compile_backend=failing_backend)
    lines = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(lines) == 1 and "no compiler here" in lines[0] and "eager" in lines[0]
    assert engine.options.compile is False and engine.compile_seconds is None and not is_compiled(engine.module)
    eager = RankEngine(one_rank, 0, build_groups(one_rank, 0), torch.device("cpu"), OPTIM, seed=SEED)
    batch = make_batches(one_rank, steps=1)[0]
    assert engine.train_step(batch).loss == eager.train_step(batch).loss


# --------------------------------------------------------------------------- inductor, several gloo processes


def _rank_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, compiled: bool) -> None:
    with gloo_rank(rank, world, init_file, deterministic=False):
        plan = Plan.model_validate_json(plan_json)
        engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OPTIM, seed=SEED,
                            options=RuntimeOptions(compile=compiled))
        results, grads = [], {}
        for step, batch in enumerate(make_batches(plan)):
            result = engine.train_step(batch[engine.pipeline_slice(plan.inputs.train.global_batch)])
            results.append((result.loss, result.grad_norm))
            if step == 0:
                grads = engine.gather_full_grads()
        torch.save({"results": results, "grads": grads, "params": engine.gather_full_params(),
                    "compiled": engine.options.compile, "tp": engine.tp.size},
                   Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(4, _rank_job) as workers:
        yield workers


def _run(plan: Plan, compiled: bool, tmp_path: Path, pool: WorkerPool) -> list[dict[str, Any]]:
    out = tmp_path / f"run-{compiled}"
    out.mkdir()
    pool.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out), compiled)
              for rank in range(plan.world_size)])
    return [torch.load(out / f"rank{r}.pt") for r in range(plan.world_size)]


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                    reason="inductor needs a C++ compiler on the CPU")
def test_compiled_asymmetric_plan_equals_eager_and_one_device(tmp_path: Path, pool: WorkerPool) -> None:
    """Pipeline 0: a TP-1 stage (layers 0-1, embedding) then a TP-2 stage (layers 2-3, vocabulary-parallel
    chunked loss): compiled layers whole at TP 1 and in pieces between the all-reduces at TP 2. Pipeline 1: one
    TP-1 stage with everything (the TP-1 loss chunk). Compiled with inductor, fp32."""
    plan = make_plan("llama-tiny", [(1, 2, [(1, (0, 2)), (2, (2, 4))]), (2, 1, [(1, (0, 4))])])
    compiled, eager = _run(plan, True, tmp_path, pool), _run(plan, False, tmp_path, pool)
    assert [o["compiled"] for o in compiled] == [True] * 4 and [o["tp"] for o in compiled] == [1, 2, 2, 1]
    ref = reference_train(plan.inputs.model, make_batches(plan), OPTIM, seed=SEED)
    tokens = plan.inputs.train.tokens_per_step
    seen: set[str] = set()
    for rank, (got, want) in enumerate(zip(compiled, eager, strict=True)):
        losses = torch.tensor([r[0] for r in got["results"]], dtype=torch.float64)
        for other, label in ((torch.tensor([r[0] for r in want["results"]], dtype=torch.float64), "eager"),
                             (torch.tensor(ref.losses, dtype=torch.float64), "one device")):
            _assert_close(f"rank {rank} losses vs {label}", losses, other, RTOL, 0.0)
        norms = torch.tensor([r[1] for r in got["results"]], dtype=torch.float64)
        _assert_close(f"rank {rank} grad norms", norms, torch.tensor(ref.grad_norms, dtype=torch.float64), RTOL, 0.0)
        for name, grad in got["grads"].items():
            for other, label in ((want["grads"][name], "eager"), (ref.grads[0][name], "one device")):
                _assert_close(f"rank {rank} grad {name} vs {label}", grad, other, RTOL, grad_atol(other, tokens))
            _assert_params(f"rank {rank} param {name} vs eager", got["params"][name], want["params"][name])
            _assert_params(f"rank {rank} param {name} vs one device", got["params"][name], ref.params[name])
            seen.add(name)
    assert seen == set(ref.params) and ref.losses[0] != ref.losses[-1] and len(ref.losses) == STEPS

"""Weights cast once per step (RuntimeOptions.cast_once, runtime/model/working_weights.py): the same arithmetic as
autocast's per-micro-batch casts, with one 16-bit copy per stage.

- One rank, bf16, several micro-batches, with and without recompute: cast once and cast per micro-batch give
  bitwise the same losses, gradients and parameters (the same casts, matmuls and fp32 accumulations, in the same
  order), and both follow the one-device reference within the bf16 tolerance below; the fp32 parameters are the
  module's again after a step, and the copies were made once per step.
- Several gloo ranks, an asymmetric plan (TP 1 then TP 2, two unlike pipelines), bf16: the same, bitwise.
- The record: cast_once is written to runtime.json, and older records read as cast per micro-batch.
- Compiled (aot_eager), with and without recompute: every graph made in the warm-up, losses as eager's.

Tolerance against the reference (bf16): u = 2^-8 is bf16's unit roundoff; the reference runs the same bf16
matmuls per token row, the runtime sums micro-batch gradients in another order and the chunked loss takes its
chunks: a relative error of a few u in single activations, a fraction of it in the mean loss. Bound: u relative
per step's loss (the fp16 analogue in tests/test_loss_scale.py, with bf16's u).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.model.working_weights import WorkingWeights
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.reference import reference_train
from flashflex_cli.semantics.runtime_paths import LEGACY, RuntimeOptions, from_record
from tests.infra.worker_pool import WorkerPool, gloo_rank
from tests.test_parity import OPTIM, SEED, make_batches, make_plan

STEPS = 2
BF16_U = 2.0**-8


def _train(plan: Plan, rank: int, cast_once: bool) -> dict[str, Any]:
    """STEPS steps of `plan` on `rank` (collective): losses, first-step full gradients, final full parameters,
    and how many copies each step made."""
    engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OPTIM, seed=SEED,
                        options=RuntimeOptions(cast_once=cast_once))
    casts = [0]
    if engine.working is not None:
        original = engine.working.cast

        def counted(forwards: int | None) -> Any:
            casts[0] += 1
            return original(forwards)

        engine.working.cast = counted  # type: ignore[method-assign]
    losses, grads = [], {}
    for step, batch in enumerate(make_batches(plan, steps=STEPS)):
        losses.append(engine.train_step(batch[engine.pipeline_slice(plan.inputs.train.global_batch)]).loss)
        if step == 0:
            grads = engine.gather_full_grads()
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.float32 for p in engine.module.parameters())
    return {"losses": losses, "grads": grads, "params": engine.gather_full_params(), "casts": casts[0],
            "working": engine.working is not None}


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["losses"] == want["losses"]
    for kind in ("grads", "params"):
        assert set(got[kind]) == set(want[kind])
        for name, tensor in want[kind].items():
            assert torch.equal(got[kind][name], tensor), f"{kind} {name} differs"


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_one_rank_cast_once_is_bitwise_autocast_and_follows_the_reference(world_of_one: None,
                                                                          recompute: bool) -> None:
    plan = make_plan("llama-tiny", [(2, 3, [(1, (0, 4))])], dtype="bf16", recompute=recompute)
    once, per_micro_batch = _train(plan, 0, True), _train(plan, 0, False)
    assert once["working"] and not per_micro_batch["working"]
    assert once["casts"] == STEPS  # once per step, not per micro-batch (3 here)
    _same(once, per_micro_batch)
    ref = reference_train(plan.inputs.model, make_batches(plan, steps=STEPS), OPTIM, seed=SEED, dtype="bf16",
                          chunked_loss=True)
    for got, want in zip(once["losses"], ref.losses, strict=True):
        assert got == pytest.approx(want, rel=BF16_U)


def test_the_copies_are_the_layers_matrices_in_bf16_and_gradients_reach_the_fp32_parameters() -> None:
    from flashflex_cli.model.spec import PRESETS
    from flashflex_cli.runtime.model.stage import StageModule
    from flashflex_cli.runtime.model.tensor_parallel import TPContext

    spec = PRESETS["llama-tiny"]
    module = StageModule(spec, (0, 2), True, True, TPContext(group=None), chunked_loss=True)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.02)
    working = WorkingWeights(module, torch.bfloat16)
    matrices = [p for name, p in module.named_parameters() if name.startswith("layers.") and p.dim() == 2]
    assert len(working.slots) == len(matrices) == 14
    assert working.copy_bytes() == sum(p.numel() for p in matrices) * 2
    tokens = torch.randint(0, spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    grads = {}
    for cast_once in (False, True):
        module.zero_grad(set_to_none=True)
        with working.cast() if cast_once else torch.autocast("cpu", enabled=False):
            if cast_once:
                assert all(owner.working[name].dtype == torch.bfloat16 for owner, name in working.slots)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                module(tokens[:, :-1], tokens[:, 1:]).backward()
        grads[cast_once] = {name: p.grad for name, p in module.named_parameters()}
    assert all(not owner.working for owner, _ in working.slots)  # freed after the step
    for name, grad in grads[False].items():
        assert grad.dtype == torch.float32 and torch.equal(grads[True][name], grad), name


def test_the_switch_is_recorded_and_old_records_cast_per_micro_batch() -> None:
    assert not RuntimeOptions().cast_once and not LEGACY["cast_once"]  # opt-in (semantics/runtime_paths.py)
    assert not from_record({}, "bf16", True).options.cast_once
    record = RuntimeOptions(cast_once=True).resolved(True).to_record("bf16")
    assert record["cast_once"] is True and from_record(record, "bf16", True).options.cast_once
    with pytest.raises(ValueError, match="cast_once"):
        from_record({"cast_once": "yes"}, "bf16", True)


def _rank_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, cast_once: bool) -> None:
    with gloo_rank(rank, world, init_file):
        torch.save(_train(Plan.model_validate_json(plan_json), rank, cast_once), Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(4, _rank_job) as workers:
        yield workers


@pytest.mark.slow
def test_asymmetric_plan_cast_once_is_bitwise_autocast(tmp_path: Path, pool: WorkerPool) -> None:
    plan = make_plan("llama-tiny", [(1, 3, [(1, (0, 2)), (2, (2, 4))]), (2, 1, [(1, (0, 4))])], dtype="bf16")
    outputs = {}
    for cast_once in (True, False):
        out = tmp_path / f"run-{cast_once}"
        out.mkdir()
        pool.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out), cast_once)
                  for rank in range(plan.world_size)])
        outputs[cast_once] = [torch.load(out / f"rank{r}.pt") for r in range(plan.world_size)]
    for got, want in zip(outputs[True], outputs[False], strict=True):
        assert got["working"] and got["casts"] == STEPS
        _same(got, want)


@pytest.mark.parametrize("scope", ["stage", "block"])
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
def test_compiled_cast_once_compiles_in_the_warm_up_and_trains_like_eager(world_of_one: None, recompute: bool,
                                                                          scope: str) -> None:
    """Compiled (aot_eager: inductor's input graphs, run eagerly) with working weights: every graph is made in the
    warm-up (the steps compile nothing: the copies of each step are graph inputs, not constants), and the losses
    equal the eager cast-once engine's within fp32 rounding of the compiled element-wise work (tests/test_compile.py)."""
    from tests.test_compile import CountingBackend

    torch._dynamo.reset()
    plan = make_plan("llama-tiny", [(2, 2, [(1, (0, 4))])], dtype="bf16", recompute=recompute)
    backend = CountingBackend()
    compiled = RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), OPTIM, seed=SEED,
                          options=RuntimeOptions(compile=True, cast_once=True, compile_scope=scope),
                          compile_backend=backend)
    eager = RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), OPTIM, seed=SEED,
                       options=RuntimeOptions(cast_once=True))
    assert compiled.options.compile_scope == scope
    assert compiled.options.compile and compiled.working is not None
    graphs = len(backend.graphs)
    for batch in make_batches(plan, steps=STEPS):
        got, want = compiled.train_step(batch), eager.train_step(batch)
        assert got.loss == pytest.approx(want.loss, rel=BF16_U)
    assert len(backend.graphs) == graphs

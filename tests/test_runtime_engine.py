"""RankEngine API on a one-rank plan (a gloo group of one in this process): steps, errors, checkpoint state."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from flashflex_cli.errors import InputError
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine
from flashflex_cli.runtime.training.optimizer import lr_at
from flashflex_cli.runtime.training.reference import reference_train
from flashflex_cli.semantics.runtime_paths import RuntimeOptions
from tests.test_parity import make_batches, make_plan

OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, total_steps=10)


@pytest.fixture
def one_rank(world_of_one: None) -> Plan:
    """A one-device plan (2 micro-batches of 2 sequences) with torch.distributed initialised for it."""
    return make_plan("llama-tiny", [(2, 2, [(1, (0, 4))])])


def _engine(plan: Plan, seed: int = 0, **kwargs: Any) -> RankEngine:
    return RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), OPTIM, seed=seed, **kwargs)


def test_step_matches_reference_and_reports_timings(one_rank: Plan) -> None:
    engine = _engine(one_rank, seed=3)
    batches = make_batches(one_rank, steps=2)
    ref = reference_train(one_rank.inputs.model, batches, OPTIM, seed=3)
    for step, batch in enumerate(batches):
        result = engine.train_step(batch[engine.pipeline_slice(4)])
        assert result.loss == pytest.approx(ref.losses[step], rel=1e-5)
        assert result.grad_norm == pytest.approx(ref.grad_norms[step], rel=1e-5)
        assert result.lr == lr_at(step, OPTIM)
    assert engine.step == 2
    assert {"forward", "backward", "p2p", "tp_comm", "dp_sync", "optimizer", "step"} <= set(result.timings)
    assert all(v >= 0 for v in result.timings.values())
    assert result.timings["step"] >= result.timings["forward"] + result.timings["backward"]


def test_bad_inputs_are_input_errors(one_rank: Plan) -> None:
    engine = _engine(one_rank)
    with pytest.raises(InputError, match=r"tokens have shape \[4, 10\], this pipeline expects \[4, 17\]"):
        engine.train_step(torch.zeros(4, 10, dtype=torch.int64))
    with pytest.raises(InputError, match="global batch 8 != plan global_batch 4"):
        engine.pipeline_slice(8)
    with pytest.raises(InputError, match="checkpoint shape"):
        engine.load_from_full(lambda key: torch.zeros(3) if key != "step" else torch.tensor(1))
    # tied embeddings are supported now: tests/test_hf_families.py and tests/test_hf_equivalence.py


def test_checkpoint_state_round_trip(one_rank: Plan) -> None:
    batches = make_batches(one_rank, steps=3)
    a = _engine(one_rank, seed=1)
    for batch in batches[:2]:
        a.train_step(batch)
    state = a.state_for_checkpoint()
    names = {spec.name for spec in a.shard_specs()}
    assert set(state) == names | {f"{n}.exp_avg" for n in names} | {f"{n}.exp_avg_sq" for n in names} | {
        "step", "optimizer_steps"}  # no loss scale outside fp16 plans
    assert int(state["step"]) == 2 == int(state["optimizer_steps"]) and all(spec.owner for spec in a.shard_specs())
    assert float(state["embed.exp_avg_sq"].abs().sum()) > 0
    full = a.gather_full_state()
    b = _engine(one_rank, seed=2)
    assert not torch.equal(b.gather_full_params()["embed"], full["embed"])
    b.load_from_full(full.__getitem__)
    assert b.step == 2
    ra, rb = a.train_step(batches[2]), b.train_step(batches[2])
    assert ra.loss == rb.loss and ra.lr == rb.lr
    for name, param in a.gather_full_params().items():
        assert torch.equal(param, b.gather_full_params()[name]), name


def test_slowdown_is_applied(one_rank: Plan) -> None:
    engine = _engine(one_rank, slowdown=2.0)
    # Run-queue delay is host contention that the slowdown absorbs (runtime/device/slowdown.py); on a loaded host it
    # can cover the whole stretch and leave nothing to sleep. Count none, so the check holds at any load.
    engine.slow.queue_clock = lambda: 0.0
    phase = ["pipeline"]
    update = engine.optimizer.step
    engine.optimizer.step = lambda *a, **k: (phase.append("optimizer"), update(*a, **k))[1]
    sleeps: list[tuple[str, float]] = []
    engine.slow.sleep = lambda seconds: (sleeps.append((phase[-1], seconds)), time.sleep(seconds))
    result = engine.train_step(make_batches(one_rank, steps=1)[0])
    compute = result.timings["forward"] + result.timings["backward"] + result.timings["optimizer"]
    assert 0 < engine.slow.slept <= compute / 2 + 1e-3
    # the optimizer's update is stretched too (the cost model divides the device's bandwidth by its slowdown)
    assert [phase for phase, seconds in sleeps if seconds > 0][-1] == "optimizer"


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_a_step_reads_nothing_back_from_the_device_before_its_end(one_rank: Plan, dtype: str) -> None:
    """No `.item()`, `float(tensor)` or `bool(tensor)` (each a blocking device read on a GPU) in a whole step,
    gradient clipping included: the loss and the gradient norm come back in one `tolist()` after the optimizer
    step (not a dispatched op, so not counted here). The fused optimizer keeps its step counters on the device
    (foreach keeps them on the host and reads them there, which is no device read). fp16: the loss scaler's
    overflow flag goes into the fused kernel and the scale update, both on the device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    plan = one_rank.model_copy(update={"inputs": one_rank.inputs.model_copy(update={
        "train": one_rank.inputs.train.model_copy(update={"dtype": dtype})})})
    engine = _engine(plan, options=RuntimeOptions(optimizer="fused"))
    assert (engine.scaler is not None) == (dtype == "fp16")
    reads: list[str] = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append(str(func))
            return func(*args, **(kwargs or {}))

    batches = make_batches(one_rank, steps=2)
    engine.train_step(batches[0])  # the optimizer's state is created in the first step
    with Reads():
        result = engine.train_step(batches[1])
    assert reads == [] and result.grad_norm > 0 and result.loss > 0
    probe: list[str] = []
    with Reads():
        reads.clear()
        float(torch.ones(()))  # the mode does see a read
        probe.extend(reads)
    assert probe

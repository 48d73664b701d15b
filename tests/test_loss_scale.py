"""fp16 plans: dynamic loss scaling global to the job (runtime/training/loss_scale.py).

An asymmetric plan (two pipelines, TP 2 -> 1 in one and 1 -> 2 in the other, unlike micro-batch counts) trains in
fp16 on gloo processes with the same skipped steps and loss scales as torch's one-device loop (autocast and
torch.amp.GradScaler, runtime/training/reference.py), and losses within the tolerance justified at LOSS_RTOL; an overflow
injected on one rank is skipped by every rank (no parameter or AdamW moment changes anywhere, the scale backs
off everywhere); a checkpoint taken mid-run resumes under another plan with the same scale and growth tracker.

The scaling settings are chosen so that every decision has a wide margin, and so must be the same in any layout:
on these batches the gradients first overflow fp16 between the scales 2^19 and 2^20 (measured with the reference:
2^19 clean, 2^20 overflows), so the initial 2^24 overflows by 16x or more, the backoff of 2^-7 lands at 2^17
and growth (every 2 clean steps) reaches 2^18 before the injected overflow, at least 2x below it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flashflex_cli.cli import main
from flashflex_cli.errors import InputError
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runs.reader import load_run
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine
from flashflex_cli.runtime.training.loss_scale import (
    INJECT_ENV,
    LossScaling,
    OverflowInjection,
    injected_steps,
)
from flashflex_cli.runtime.training.reference import reference_train
from tests.infra.worker_pool import WorkerPool, gloo_rank
from tests.test_launch import GOLDEN, _launch, _rows
from tests.test_parity import make_batches, make_plan

SEED = 7
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, total_steps=10, weight_decay=0.1, grad_clip=1.0)
SCALING = LossScaling(init_scale=2.0**24, growth_factor=2.0, backoff_factor=2.0**-7, growth_interval=2)
STEPS = 7
INJECT_RANK, INJECT_STEP = 3, 3  # pipeline 1's first stage (TP 1): it neither scales the loss nor is in pipeline 0
# step 0 overflows by itself, step 3 by injection; growth after steps 2 and 5
WANT_SCALES = [2.0**24, 2.0**17, 2.0**17, 2.0**18, 2.0**11, 2.0**11, 2.0**12]
WANT_SKIPPED = [True, False, False, True, False, False, False]
# fp16's unit roundoff u = 2^-11 = 4.9e-4. The layouts round differently from the reference: a TP-split matmul
# rounds each partial sum to fp16 before the all-reduce adds them, and a stage boundary sends the fp32 residual
# stream as fp16; each is a relative error of at most u in an activation, and the mean cross-entropy over the
# batch moves by a fraction of it. Parameters then take Adam steps from gradients that differ by such roundings.
# Bound: u relative on every step's loss (observed: at most 1.5e-5 on PLAN_A over 7 steps, 30x inside).
LOSS_RTOL = 2.0**-11


def fp16_plan(pipelines: list[tuple[int, int, list[tuple[int, tuple[int, int]]]]]) -> Plan:
    return make_plan("llama-tiny", pipelines, dtype="fp16")


PLAN_A = fp16_plan([(1, 2, [(2, (0, 2)), (1, (2, 4))]), (1, 3, [(1, (0, 1)), (2, (1, 4))])])
PLAN_B = fp16_plan([(1, 5, [(1, (0, 1)), (2, (1, 3)), (1, (3, 4))])])  # one pipeline, TP 1 -> 2 -> 1


# ----------------------------------------------------------------------------------------------- settings


def test_settings_and_injection_are_checked() -> None:
    assert LossScaling() == LossScaling(2.0**16, 2.0, 0.5, 2000)  # torch.amp.GradScaler's defaults
    for bad in ({"init_scale": 0.0}, {"init_scale": float("inf")}, {"growth_factor": 1.0},
                {"backoff_factor": 1.0}, {"growth_interval": 0}):
        with pytest.raises(InputError):
            LossScaling(**bad)  # type: ignore[arg-type]
    assert OverflowInjection.parse("rank=2,step=5") == OverflowInjection(2, 5)
    assert injected_steps({"FLASHFLEX_OVERFLOW_INJECT": "rank=2,step=5"}, 2) == {5}
    assert injected_steps({"FLASHFLEX_OVERFLOW_INJECT": "rank=2,step=5"}, 1) == set()
    assert injected_steps({}, 0) == set()
    for text, message in (("rank=1", "required"), ("rank=1,step=x", "whole number"), ("rank=-1,step=0", "negative"),
                          ("rank=1,phase=2", "not one of")):
        with pytest.raises(InputError, match=message):
            OverflowInjection.parse(text)


# ------------------------------------------------------------------------------------------- one process


def test_one_rank_follows_torch_gradscaler_loop(world_of_one: None) -> None:
    """One rank, two micro-batches, bf16 and fp16: bf16 creates no scaler; fp16 skips exactly the reference's
    steps with its scales, and its AdamW counts only the updates taken."""
    plan = fp16_plan([(2, 2, [(1, (0, 4))])])
    batches = make_batches(plan, steps=STEPS)
    engine = RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), OPTIM, seed=SEED,
                        loss_scaling=SCALING, overflow_steps={INJECT_STEP})
    results = [engine.train_step(batch) for batch in batches]
    ref = reference_train(plan.inputs.model, batches, OPTIM, seed=SEED, dtype="fp16", scaling=SCALING,
                          overflow_steps={INJECT_STEP}, chunked_loss=True)
    assert ref.loss_scales == WANT_SCALES and ref.skipped == WANT_SKIPPED
    assert [r.loss_scale for r in results] == WANT_SCALES and [r.skipped for r in results] == WANT_SKIPPED
    for got, want in zip(results, ref.losses, strict=True):
        assert got.loss == pytest.approx(want, rel=LOSS_RTOL)
    assert engine.step == STEPS and engine.optimizer_steps == WANT_SKIPPED.count(False)
    steps = {float(s["step"]) for s in engine.optimizer.state.values()}
    assert steps == {float(engine.optimizer_steps)}
    state = engine.state_for_checkpoint()
    assert float(state["loss_scale"]) == 2.0**12 and int(state["loss_scale_growth_tracker"]) == 1
    assert int(state["optimizer_steps"]) == 5 and int(state["step"]) == STEPS

    bf16 = make_plan("llama-tiny", [(2, 2, [(1, (0, 4))])], dtype="bf16")
    plain = RankEngine(bf16, 0, build_groups(bf16, 0), torch.device("cpu"), OPTIM, seed=SEED,
                       overflow_steps={0})  # no scaler: nothing is injected, nothing skipped
    result = plain.train_step(batches[0])
    assert plain.scaler is None and result.loss_scale is None and not result.skipped
    assert "loss_scale" not in plain.state_for_checkpoint()


def test_an_old_checkpoint_resumes_with_the_initial_scale(world_of_one: None) -> None:
    """A checkpoint written before loss scaling existed (tests/golden/adamw-ckpt: no scale, no optimizer_steps)
    loads into an fp16 engine: the initial scale, a zero growth tracker, every step an update."""
    from tests.golden import make_adamw_checkpoint as golden

    old = golden.plan()
    plan = old.model_copy(update={"inputs": old.inputs.model_copy(update={
        "train": old.inputs.train.model_copy(update={"dtype": "fp16"})})})
    engine = RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), golden.OPTIM, seed=golden.SEED,
                        loss_scaling=SCALING)
    found = ckpt.latest_checkpoint(Path(__file__).parent / "golden" / "adamw-ckpt")
    assert found is not None and "loss_scale" not in ckpt.read_manifest(found)["tensors"]
    engine.load_local(lambda targets: ckpt.load_into(found, targets))
    state = engine.state_for_checkpoint()
    assert engine.step == engine.optimizer_steps == golden.STEPS_BEFORE
    assert float(state["loss_scale"]) == SCALING.init_scale and int(state["loss_scale_growth_tracker"]) == 0


# ------------------------------------------------------------------------------------------ several ranks


def _full_state(engine: RankEngine) -> dict[str, torch.Tensor]:
    """Parameters and AdamW moments as full tensors (collective over the TP group)."""
    return {k: v for k, v in engine.gather_full_state().items() if v.dim() > 0}


def _worker(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, steps: tuple[int, int],
            resume: str, save: str) -> None:
    """Steps [a, b) of the plan (after resuming from checkpoint folder `resume`; then saving one into `save`);
    saves each step's results and whether this rank's full parameters and moments changed in it."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OPTIM, seed=SEED,
                            loss_scaling=SCALING, overflow_steps={INJECT_STEP} if rank == INJECT_RANK else ())
        if resume:
            found = ckpt.latest_checkpoint(resume)
            engine.load_local(lambda targets: ckpt.load_into(found, targets))
        resumed = (engine.step, engine.optimizer_steps, {float(s["step"]) for s in engine.optimizer.state.values()})
        batches = make_batches(plan, steps=steps[1])
        results, changed = [], []
        for step in range(*steps):
            before = _full_state(engine)
            r = engine.train_step(batches[step][engine.pipeline_slice(plan.inputs.train.global_batch)])
            after = _full_state(engine)
            results.append((r.loss, r.lr, r.loss_scale, r.skipped))
            changed.append(any(not torch.equal(before[k], after[k]) for k in before))
        if save:
            state = engine.state_for_checkpoint()
            ckpt.save(save, engine.step, state, ckpt.shards_for(state, engine.shard_specs(), rank), {})
        torch.save({"results": results, "changed": changed, "resumed": resumed, "step": engine.step,
                    "optimizer_steps": engine.optimizer_steps}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(6, _worker) as workers:
        yield workers


@pytest.fixture(scope="module")
def reference() -> Any:
    batches = make_batches(PLAN_A, steps=STEPS)
    return reference_train(PLAN_A.inputs.model, batches, OPTIM, seed=SEED, dtype="fp16", scaling=SCALING,
                           overflow_steps={INJECT_STEP}, chunked_loss=True)


def _run(plan: Plan, tmp_path: Path, pool: WorkerPool, steps: tuple[int, int], resume: Path | None = None,
         save: Path | None = None) -> list[dict[str, Any]]:
    out = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
    out.mkdir()
    pool.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out), steps, str(resume or ""),
               str(save or "")) for rank in range(plan.world_size)])
    return [torch.load(out / f"rank{r}.pt") for r in range(plan.world_size)]


def _check(outputs: list[dict[str, Any]], ref: Any, steps: tuple[int, int]) -> list[float]:
    """Every rank: the reference's scales and skipped steps exactly, its losses within LOSS_RTOL, no change of
    state in a skipped step and a change in every other. Returns the relative loss differences."""
    diffs = []
    span = range(*steps)
    for rank, out in enumerate(outputs):
        losses, lrs, scales, skipped = (list(column) for column in zip(*out["results"], strict=True))
        assert scales == [ref.loss_scales[s] for s in span], f"rank {rank} scales {scales}"
        assert skipped == [ref.skipped[s] for s in span], f"rank {rank} skipped {skipped}"
        assert out["changed"] == [not s for s in skipped], f"rank {rank}: state changed {out['changed']}"
        for step, loss in zip(span, losses, strict=True):
            diffs.append(abs(loss / ref.losses[step] - 1))
            assert loss == pytest.approx(ref.losses[step], rel=LOSS_RTOL), f"rank {rank} step {step}"
        assert out["step"] == steps[1]
        assert out["optimizer_steps"] == ref.skipped[:steps[1]].count(False)
    return diffs


@pytest.mark.slow
def test_asymmetric_plan_skips_and_scales_as_one_device(tmp_path: Path, pool: WorkerPool, reference: Any) -> None:
    """PLAN_A (TP 2 -> 1 and 1 -> 2 at the stage boundaries) over 7 steps: the reference's skipped steps and
    scales on every rank, the natural overflow of step 0 and the overflow injected on rank 3 at step 3 included;
    in both no rank's parameters or moments change. Observed loss difference: at most 1.5e-5 relative."""
    assert reference.loss_scales == WANT_SCALES and reference.skipped == WANT_SKIPPED
    outputs = _run(PLAN_A, tmp_path, pool, (0, STEPS))
    diffs = _check(outputs, reference, (0, STEPS))
    assert max(diffs) > 0  # fp16 layouts do round differently: the tolerance is needed, and used
    print(f"fp16 parity: max relative loss difference {max(diffs):.2e} over {STEPS} steps x {len(outputs)} ranks")


@pytest.mark.slow
def test_checkpoint_resumes_the_scale_under_another_plan(tmp_path: Path, pool: WorkerPool,
                                                         reference: Any) -> None:
    """5 steps under PLAN_A, a checkpoint (scale 2^11, growth tracker 1, 3 AdamW updates of 5 steps), then steps
    5 and 6 under PLAN_B: the scale grows after step 5 as in the uninterrupted reference (it would not with the
    tracker lost) and AdamW resumes at its third update."""
    save = tmp_path / "ckpt"
    _check(_run(PLAN_A, tmp_path, pool, (0, 5), save=save), reference, (0, 5))
    found = ckpt.latest_checkpoint(save)
    assert found is not None and ckpt.read_manifest(found)["tensors"]["loss_scale"]["dtype"] == "float32"
    outputs = _run(PLAN_B, tmp_path, pool, (5, STEPS), resume=save)
    _check(outputs, reference, (5, STEPS))
    assert all(out["resumed"] == (5, 3, {3.0}) for out in outputs)


# ------------------------------------------------------------------------------------------------ launch


def _fp16_copy(name: str, folder: Path) -> Path:
    """The golden plan `name` (tests/golden, the 2-node CPU cluster) trained in fp16 instead."""
    data = json.loads((GOLDEN / name).read_text())
    data["inputs"]["train"]["dtype"] = "fp16"
    out = folder / name.replace(".json", "-fp16.json")
    out.write_text(json.dumps(data))
    return out


@pytest.mark.slow
def test_launch_skips_an_injected_overflow_and_resumes_the_scale_under_another_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`flashflex launch` of an fp16 plan on 4 emulated CPU ranks, with rank 3 (the second pipeline; not rank 0,
    which writes the metrics) made to overflow at step 1: every rank skips it (rank 0's row says so, and the
    scale halves), a checkpoint after step 3 holds the scale, and a resumed launch under the 3-rank plan
    continues with it. A one-rank launch with the same overflow gives the same losses, scales and skips.
    `show --run` tells the skipped steps; the same run without the fp16 fields (an older run) reads as before."""
    plan4, plan3, plan1 = (_fp16_copy(f"plan-{n}rank.json", tmp_path) for n in (4, 3, 1))
    run, ck, solo = tmp_path / "run", tmp_path / "ck", tmp_path / "solo"
    schedule = ("--steps", "3", "--schedule-steps", "5")
    first = _launch(plan4, run, *schedule, "--checkpoint-dir", str(ck), env={INJECT_ENV: "rank=3,step=1"})
    assert first.returncode == 0, first.stderr
    assert "skipped (inf/NaN gradients)" in first.stderr and "fp16 autocast without loss scaling" not in first.stderr
    assert json.loads((run / "runtime.json").read_text())["loss_scaling"] == LossScaling().to_record()
    found = ckpt.latest_checkpoint(ck)
    assert found is not None and found.name == "step-000003"
    resumed = _launch(plan3, run, "--steps", "5", "--schedule-steps", "5", "--checkpoint-dir", str(ck), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "at step 3 (loss scale 32768)" in resumed.stderr
    alone = _launch(plan1, solo, "--steps", "5", env={INJECT_ENV: "rank=0,step=1"})
    assert alone.returncode == 0, alone.stderr
    rows, want = _rows(run), _rows(solo)
    assert [r["step"] for r in rows] == list(range(1, 6))
    for row in (*rows, *want):  # the overflow was injected at step index 1: the second step, row 2
        assert row["loss_scale"] == (2.0**16 if row["step"] <= 2 else 2.0**15)
        assert row["skipped"] == (row["step"] == 2)
    for mine, ref in zip(rows, want, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL), mine["step"]
    capsys.readouterr()
    assert main(["show", str(plan3), "--run", str(run), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["run_comparison"]
    assert shown["loss_scaling"] == {"steps": 5, "skipped_steps": 1, "last_scale": 32768.0}
    assert main(["show", str(plan3), "--run", str(run)]) == 0
    assert "fp16 loss scaling: 1 of 5 steps skipped (inf/NaN gradients), last scale 32768" in capsys.readouterr().out
    old = [{k: v for k, v in row.items() if k not in ("loss_scale", "skipped")} for row in rows]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in old))
    assert load_run(run).loss_scaling() is None
    assert main(["show", str(plan3), "--run", str(run), "--json"]) == 0
    assert "loss_scaling" not in json.loads(capsys.readouterr().out)["run_comparison"]

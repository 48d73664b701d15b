"""Low-communication training's runtime (issue 32, items 2 and 6), several gloo processes on CPU in fp32.

(a) Two replica groups of unlike layouts and inner step counts: each group's inner losses and the global
    parameters after two rounds match the single-process DiLoCo reference (runtime/training/reference_rounds.py).
(b) One group, outer lr 1 and momentum 0 (the outer step then sets the global parameters to the local ones):
    the same losses as synchronous training (the plain reference loop) on the same batches.
(c) A checkpoint after one round (DCP, with the outer momentum and round) resumes under another layout of the
    same groups, and the second round equals the reference's.

Tolerances. Losses: 1e-5 relative, as tests/test_parity.py (the group sums its gradients in another order than
the reference). Parameters: every element within 1e-5 relative + 1e-6 absolute except a tiny fraction (< 0.1%)
that AdamW's normalised step may move by up to 2 lr per inner step when its gradient is near zero (see
test_parity._assert_params); the outer step multiplies such a difference by at most lr_outer * (1 + momentum)
= 1.33 per round.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.data import SyntheticSource
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.optimizer import lr_at
from flashflex_cli.runtime.training.reference import reference_train
from flashflex_cli.runtime.training.reference_rounds import reference_rounds
from flashflex_cli.runtime.training.rounds import RoundTrainer
from flashflex_cli.semantics.outer_sync import (
    group_inner_steps,
    group_pipelines,
    group_weights,
    round_rows,
    round_sequences,
)
from tests.infra.worker_pool import WorkerPool, gloo_rank
from tests.test_parity import OPTIM, SEED, make_plan

RTOL = 1e-5
DATA_SEED = 99


def grouped(layout: list[Any], groups: list[tuple[list[int], int]], lr: float = 0.7, momentum: float = 0.9,
            compression: str = "fp32") -> Plan:
    """make_plan's layout with an outer_sync section of `groups` [(pipelines, inner_steps), ...]."""
    data = json.loads(make_plan("llama-tiny", layout).to_json())
    data["outer_sync"] = {"groups": [{"pipelines": p, "inner_steps": h} for p, h in groups],
                          "optimizer": {"lr": lr, "momentum": momentum}, "compression": compression}
    return Plan.model_validate(data)


def source_of(plan: Plan) -> SyntheticSource:
    return SyntheticSource(plan.inputs.model.vocab_size, round_sequences(plan), plan.inputs.train.seq_len,
                           seed=DATA_SEED)


def _worker(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, rounds: tuple[int, int],
            save_dir: str, resume: str) -> None:
    """Run rounds [rounds[0], rounds[1]) of the plan on `rank` (resuming from checkpoint `resume` when given, saving
    one into `save_dir` at the end when given); write the group losses and full parameters of the rank."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        groups = build_groups(plan, rank)
        engine = RankEngine(plan, rank, groups, torch.device("cpu"), OPTIM, seed=SEED + (1 if resume else 0))
        trainer = RoundTrainer(engine, source_of(plan))
        if resume:
            trainer.load_local(lambda targets: ckpt.load_into(resume, targets))
        assert trainer.round == rounds[0]
        losses = []
        for _ in range(*rounds):
            result = trainer.train_round()
            losses.append(([s.loss for s in result.steps], result.loss, result.outer_bytes))
        if save_dir:
            state = trainer.state_for_checkpoint()
            ckpt.save(save_dir, trainer.round * trainer.steps_per_round, state, ckpt.shards_for(state, engine.shard_specs(), rank), {})
        torch.save({"losses": losses, "params": engine.gather_full_params(), "pipeline": groups.pipeline,
                    "round": trainer.round}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """Five reusable worker processes (the largest plan below has 5 ranks)."""
    with WorkerPool(5, _worker) as workers:
        yield workers


def run_rounds(plan: Plan, tmp_path: Path, pool: WorkerPool, rounds: tuple[int, int], save: Path | None = None,
               resume: Path | None = None) -> list[dict[str, Any]]:
    out_dir = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
    out_dir.mkdir()
    pool.run([(rank, plan.world_size, plan.to_json(), str(out_dir / "store"), str(out_dir), rounds,
               str(save or ""), str(resume or "")) for rank in range(plan.world_size)])
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(plan.world_size)]


def group_batches(plan: Plan, rounds: int) -> list[list[list[torch.Tensor]]]:
    """batches[r][g][k]: group g's whole batch (its pipelines' rows together) at inner step k of round r."""
    source = source_of(plan)
    out = []
    for r in range(rounds):
        out.append([])
        for g, pipes in enumerate(group_pipelines(plan)):
            out[-1].append([torch.cat([source.rows(r, round_rows(plan, p, r, k).as_slice()) for p in pipes])
                            for k in range(group_inner_steps(plan)[g])])
    return out


def assert_params(name: str, got: torch.Tensor, want: torch.Tensor, inner_steps: int) -> None:
    """The module docstring's bound: 2 lr per inner step, times 1.33 per round, for a tiny fraction."""
    max_move = 2 * sum(lr_at(s, OPTIM) for s in range(inner_steps)) * 1.33 ** 2
    err = (got - want).abs()
    assert float(err.max()) <= max_move, f"{name}: differs by {float(err.max()):.3e} > {max_move:.3e}"
    bad = (err > 1e-6 + RTOL * want.abs()).float().mean().item()
    assert bad < 1e-3, f"{name}: {bad:.2%} of elements differ by more than 1e-6 + 1e-5 relative"


# group 0: pipelines 0 (one stage) and 1 (two stages), 3 sequences a step, 2 inner steps; group 1: pipeline 2 (one
# TP-2 stage), 2 sequences a step, 3 inner steps: weights 6/12 and 6/12
LAYOUT_A = [(1, 1, [(1, (0, 4))]), (1, 2, [(1, (0, 2)), (1, (2, 4))]), (2, 1, [(2, (0, 4))])]
GROUPS_A = [([0, 1], 2), ([2], 3)]
# the same groups (sequences per step, inner steps), other layouts: group 0 one TP-2 pipeline, group 1 two stages
LAYOUT_B = [(1, 3, [(2, (0, 4))]), (1, 2, [(1, (0, 3)), (1, (3, 4))])]
GROUPS_B = [([0], 2), ([1], 3)]


def assert_round_losses(plan: Plan, losses: list[tuple[Any, ...]], ref: Any, group: int, first: int = 0) -> None:
    """A rank's rounds from round `first` on, each (inner losses, round loss, ...), against the reference's: the
    inner losses of its group, the round loss the token-weighted mean of every group's mean inner loss."""
    for r, (inner, total, *_) in enumerate(losses, start=first):
        torch.testing.assert_close(torch.tensor(inner, dtype=torch.float64),
                                   torch.tensor(ref.group_losses[r][group], dtype=torch.float64), rtol=RTOL, atol=0)
        want = sum(w * sum(ls) / len(ls) for w, ls in zip(group_weights(plan), ref.group_losses[r], strict=True))
        assert total == pytest.approx(want, rel=RTOL)


def check_against_reference(plan: Plan, outputs: list[dict[str, Any]], rounds: int, first: int = 0) -> None:
    """Every rank's inner losses, round losses and final parameters against the reference (resumed after round
    `first` when not 0: every group then continues with group 0's AdamW moments)."""
    ref = reference_rounds(plan.inputs.model, group_batches(plan, rounds), group_weights(plan), OPTIM,
                           outer_lr=0.7, outer_momentum=0.9, seed=SEED, resumed_after=first or None)
    pipe_group = {p: g for g, pipes in enumerate(group_pipelines(plan)) for p in pipes}
    for rank, out in enumerate(outputs):
        g = pipe_group[out["pipeline"]]
        assert out["round"] == rounds
        assert_round_losses(plan, out["losses"], ref, g, first)
        assert all(sent > 0 for _, _, sent in out["losses"])
        for name, param in out["params"].items():
            assert_params(f"rank {rank} {name}", param, ref.params[name], max(group_inner_steps(plan)) * rounds)


@pytest.mark.slow
def test_two_groups_match_the_diloco_reference(tmp_path: Path, pool: WorkerPool) -> None:
    plan = grouped(LAYOUT_A, GROUPS_A)
    assert group_weights(plan) == [0.5, 0.5]
    check_against_reference(plan, run_rounds(plan, tmp_path, pool, (0, 2)), rounds=2)


@pytest.mark.slow
def test_one_group_plain_averaging_is_synchronous_training(tmp_path: Path, pool: WorkerPool) -> None:
    layout = LAYOUT_A[:2]
    plan = grouped(layout, [([0, 1], 3)], lr=1.0, momentum=0.0)
    outputs = run_rounds(plan, tmp_path, pool, (0, 1))
    flat = [batch for round_batches in group_batches(plan, 1) for batch in round_batches[0]]
    ref = reference_train(plan.inputs.model, flat, OPTIM, seed=SEED)
    for out in outputs:
        inner, _, _ = out["losses"][0]
        torch.testing.assert_close(torch.tensor(inner, dtype=torch.float64),
                                   torch.tensor(ref.losses, dtype=torch.float64), rtol=RTOL, atol=0)
        for name, param in out["params"].items():  # global = global - 1.0 * (global - local): fp32 rounding
            assert_params(name, param, ref.params[name], inner_steps=3)


@pytest.mark.slow
def test_checkpoint_resumes_under_another_layout(tmp_path: Path, pool: WorkerPool) -> None:
    plan_a, plan_b = grouped(LAYOUT_A, GROUPS_A), grouped(LAYOUT_B, GROUPS_B)
    assert group_weights(plan_a) == group_weights(plan_b) and round_sequences(plan_a) == round_sequences(plan_b)
    saved = tmp_path / "ckpt"
    run_rounds(plan_a, tmp_path, pool, (0, 1), save=saved)
    found = ckpt.latest_checkpoint(saved)
    assert found is not None
    outputs = run_rounds(plan_b, tmp_path, pool, (1, 2), resume=found)
    check_against_reference(plan_b, outputs, rounds=2, first=1)


@pytest.mark.slow
def test_bf16_pseudo_gradients_stay_close(tmp_path: Path, pool: WorkerPool) -> None:
    """bf16 on the wire: each element of the outer gradient carries bf16 rounding (8 bits of mantissa, relative
    error 2^-8 per term and per addition of the two groups), so the global parameters differ from the fp32-wire
    reference by at most lr_outer * (1 + momentum) * 2 * 2^-8 * |pseudo-gradient| per round; the bound below
    uses the largest pseudo-gradient element (at most 2 lr per inner step: AdamW's step is at most about lr)."""
    plan = grouped(LAYOUT_A, GROUPS_A, compression="bf16")
    outputs = run_rounds(plan, tmp_path, pool, (0, 1))
    ref = reference_rounds(plan.inputs.model, group_batches(plan, 1), group_weights(plan), OPTIM, outer_lr=0.7,
                           outer_momentum=0.9, seed=SEED, wire_dtype=torch.bfloat16)
    largest = 2 * sum(lr_at(s, OPTIM) for s in range(3))
    for out in outputs:
        for name, param in out["params"].items():
            err = float((param - ref.params[name]).abs().max())
            assert err <= 1.33 * 2 * 2**-8 * largest + 1e-6, f"{name}: {err:.3e}"
        assert out["losses"][0][2] > 0

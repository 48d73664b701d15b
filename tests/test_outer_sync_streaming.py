"""int8 pseudo-gradients and streamed fragments of low-communication training's runtime (issue 32), several gloo
processes on CPU in fp32.

(a) int8 on the wire (per-block absmax quantization, exchanged by all-gather, summed in fp32 on every holder):
    every rank ends with bitwise the same parameters; they stay within the quantization bound of the fp32-wire
    reference; the bytes counted are each bucket's int8 payload plus its fp32 scales.
(b) Streamed fragments (F = 2): every rank holds bitwise the same fragment after each fragment's outer step, the
    run matches the single-process reference of the same staggered schedule (reference_rounds(fragments=2)), the
    exchanges add up to the whole model's bytes, and a checkpoint at a round's end (fragment 0 then mid-way
    between its outer steps) resumes under another layout as the reference's resume does.

Tolerances. int8: a block's scale is its absmax / 127 and rounding errs by at most half a step, so each group's
term of the outer gradient is off by at most weight_g * largest / 254 (largest: the largest pseudo-gradient element,
at most 2 lr per inner step as in test_outer_sync_runtime's bf16 test), the token-weighted sum by at most
largest / 254 (the weights sum to 1); the first Nesterov step moves the parameters by lr (1 + momentum) times the
gradient, so they differ from the fp32 reference by at most 1.33 * largest / 254 (+ 1e-6 for fp32 rounding).
Reference parity of fragments: test_outer_sync_runtime's (1e-5 relative on losses, its parameter bound).
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
from flashflex_cli.runtime.parallel.outer_sync import INT8_BLOCK, dequantize_int8, quantize_int8
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.optimizer import lr_at
from flashflex_cli.runtime.training.reference_rounds import reference_rounds
from flashflex_cli.runtime.training.rounds import RoundTrainer
from flashflex_cli.semantics.outer_sync import (
    exchange_bytes,
    fragment_layers,
    fragment_sync_step,
    group_inner_steps,
    group_pipelines,
    group_weights,
    param_fragment,
)
from flashflex_cli.semantics.parameters import model_params
from flashflex_cli.semantics.process_groups import outer_slice_holders
from tests.infra.worker_pool import WorkerPool, gloo_rank
from tests.test_outer_sync_runtime import (
    GROUPS_A,
    GROUPS_B,
    LAYOUT_A,
    LAYOUT_B,
    assert_params,
    assert_round_losses,
    group_batches,
    grouped,
    run_rounds,
    source_of,
)
from tests.test_parity import OPTIM, SEED


def streamed(layout: list[Any], groups: list[tuple[list[int], int]], fragments: int = 1,
             compression: str = "fp32") -> Plan:
    """test_outer_sync_runtime.grouped's plan with `fragments` streamed fragments."""
    data = json.loads(grouped(layout, groups, compression=compression).to_json())
    data["outer_sync"]["fragments"] = fragments
    return Plan.model_validate(data)


def _worker(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, rounds: tuple[int, int],
            save_dir: str, resume: str) -> None:
    """test_outer_sync_runtime._worker, also recording after every outer step its fragment, the bytes it sent and
    this rank's shards of that fragment's parameters (name -> (tp, tp_rank, tensor))."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        groups = build_groups(plan, rank)
        engine = RankEngine(plan, rank, groups, torch.device("cpu"), OPTIM, seed=SEED + (1 if resume else 0))
        trainer = RoundTrainer(engine, source_of(plan))
        if resume:
            trainer.load_local(lambda targets: ckpt.load_into(resume, targets))
        syncs: list[tuple[int, int, dict[str, tuple[int, int, torch.Tensor]]]] = []
        outer, step = trainer.outer, trainer.outer.step

        def recorded(fragment: int | None = None) -> None:
            sent = outer.bytes_sent
            step(fragment)
            shards = {name: (groups.tp_size, groups.tp_rank, p.detach().clone())
                      for name, (_, p) in engine.params.items() if outer.fragment_of[name] == (fragment or 0)}
            syncs.append((fragment or 0, outer.bytes_sent - sent, shards))

        outer.step = recorded  # type: ignore[method-assign]
        assert trainer.round == rounds[0]
        losses = []
        for _ in range(*rounds):
            result = trainer.train_round()
            losses.append(([s.loss for s in result.steps], result.loss, result.outer_bytes))
        if save_dir:
            state = trainer.state_for_checkpoint()
            ckpt.save(save_dir, trainer.round * trainer.steps_per_round, state,
                      ckpt.shards_for(state, engine.shard_specs(), rank), {})
        torch.save({"losses": losses, "params": engine.gather_full_params(), "pipeline": groups.pipeline,
                    "round": trainer.round, "syncs": syncs}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """Five reusable worker processes (LAYOUT_A's ranks)."""
    with WorkerPool(5, _worker) as workers:
        yield workers


def largest_pseudo_gradient(inner_steps: int) -> float:
    """At most 2 lr per inner step (AdamW's step is at most about lr)."""
    return 2 * sum(lr_at(s, OPTIM) for s in range(inner_steps))


def bucket_bytes(plan: Plan, rank: int, int8: bool) -> int:
    """Bytes `rank` contributes in one round: per outer bucket (fragment, holders) of more than one holder, its
    elements in fp32, or in int8 plus an fp32 scale per INT8_BLOCK elements."""
    infos = {info.name: info for info in model_params(plan.inputs.model)}
    buckets: dict[tuple[int, tuple[int, ...]], int] = {}
    for sl in outer_slice_holders(plan):
        if rank in sl.ranks and len(sl.ranks) > 1:
            shape = list(infos[sl.name].shape)
            if sl.dim is not None:
                shape[sl.dim] = sl.stop - sl.start
            key = (param_fragment(sl.name, plan.inputs.model.num_layers, plan.outer_sync.fragments), sl.ranks)
            buckets[key] = buckets.get(key, 0) + int(torch.tensor(shape).prod())
    if not int8:
        return sum(4 * n for n in buckets.values())
    return sum(n + 4 * -(-n // INT8_BLOCK) for n in buckets.values())


def test_int8_quantization_error_is_at_most_half_a_step() -> None:
    torch.manual_seed(0)
    flat = torch.randn(2 * INT8_BLOCK + 100) * torch.linspace(0, 3, 2 * INT8_BLOCK + 100)
    flat[:INT8_BLOCK] = 0.0  # an all-zero block: scale 0, exact
    payload, scales = quantize_int8(flat)
    assert payload.dtype == torch.int8 and payload.shape == flat.shape and scales.shape == (3,)
    back = dequantize_int8(payload, scales)
    assert torch.equal(back[:INT8_BLOCK], flat[:INT8_BLOCK])
    step = scales.repeat_interleave(INT8_BLOCK)[:flat.numel()]
    assert bool(((back - flat).abs() <= step / 2 * (1 + 1e-5)).all())
    assert int(payload.abs().max()) == 127


def test_int8_exchange_is_charged_as_an_all_gather_of_payload_and_scales() -> None:
    n = 3 * INT8_BLOCK + 1
    assert exchange_bytes(n, "fp32", 4) == 4 * n and exchange_bytes(n, "bf16", 2) == 2 * n
    assert exchange_bytes(n, "int8", 2) == n + 4 * 4  # two holders: (n-1) B per link, as an all-reduce of B
    assert exchange_bytes(n, "int8", 4) == 2 * (n + 4 * 4)  # (n-1) B = 2 (n-1)/n (n B / 2)


def test_fragments_cover_the_layers_and_stagger_their_steps() -> None:
    assert fragment_layers(4, 2) == [(0, 2), (2, 4)] and fragment_layers(5, 3) == [(0, 1), (1, 3), (3, 5)]
    assert [param_fragment(n, 4, 2) for n in ("embed", "layers.1.attn.wq", "layers.2.mlp_norm", "norm", "head")] \
        == [0, 0, 1, 1, 1]
    assert [fragment_sync_step(4, f, 4) for f in range(4)] == [1, 2, 3, 4]
    assert [fragment_sync_step(3, f, 2) for f in range(2)] == [2, 3]
    assert [fragment_sync_step(1, f, 3) for f in range(3)] == [1, 1, 1]
    assert all(fragment_sync_step(h, 0, 1) == h for h in range(1, 6))  # F = 1: the round's end, as before


@pytest.mark.slow
def test_int8_pseudo_gradients_stay_within_the_quantization_bound(tmp_path: Path, pool: WorkerPool) -> None:
    plan = streamed(LAYOUT_A, GROUPS_A, compression="int8")
    outputs = run_rounds(plan, tmp_path, pool, (0, 1))
    ref = reference_rounds(plan.inputs.model, group_batches(plan, 1), group_weights(plan), OPTIM, outer_lr=0.7,
                           outer_momentum=0.9, seed=SEED)
    bound = 1.33 * largest_pseudo_gradient(max(group_inner_steps(plan))) / 254 + 1e-6
    for rank, out in enumerate(outputs):
        for name, param in out["params"].items():
            assert torch.equal(param, outputs[0]["params"][name]), f"rank {rank} {name} differs from rank 0"
            err = float((param - ref.params[name]).abs().max())
            assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"
        assert out["losses"][0][2] == bucket_bytes(plan, rank, int8=True)
    fp32 = streamed(LAYOUT_A, GROUPS_A)
    assert all(bucket_bytes(plan, r, True) < bucket_bytes(fp32, r, False) / 3.9 for r in range(plan.world_size))


def assert_fragments_agree(outputs: list[dict[str, Any]]) -> None:
    """After every outer step, every rank's shards of the fragment equal rank 0's full tensors (rank 0 holds the
    whole model: LAYOUT_A's pipeline 0 is one stage) bitwise."""
    infos = {info.name: info for info in model_params(LAYOUT_A_PLAN.inputs.model)}
    for rank, out in enumerate(outputs):
        assert [f for f, _, _ in out["syncs"]] == [f for f, _, _ in outputs[0]["syncs"]]
        for (_, _, shards), (_, _, full) in zip(out["syncs"], outputs[0]["syncs"], strict=True):
            for name, (tp, tp_rank, tensor) in shards.items():
                want = infos[name].take(full[name][2], tp, tp_rank)
                assert torch.equal(tensor, want), f"rank {rank} {name} differs after its fragment's outer step"


LAYOUT_A_PLAN = streamed(LAYOUT_A, GROUPS_A)


def check_streamed(plan: Plan, outputs: list[dict[str, Any]], rounds: int, first: int = 0) -> None:
    """Inner losses, round losses and final global parameters against the staggered reference (resumed after
    round `first` when not 0)."""
    ref = reference_rounds(plan.inputs.model, group_batches(plan, rounds), group_weights(plan), OPTIM,
                           outer_lr=0.7, outer_momentum=0.9, seed=SEED, resumed_after=first or None,
                           fragments=plan.outer_sync.fragments)
    pipe_group = {p: g for g, pipes in enumerate(group_pipelines(plan)) for p in pipes}
    for rank, out in enumerate(outputs):
        g = pipe_group[out["pipeline"]]
        assert out["round"] == rounds
        assert_round_losses(plan, out["losses"], ref, g, first)
        # the last fragment's parameters are the global ones at a round's end; the others are compared through
        # the parameters after their own outer step (assert_fragments_agree) and the losses that follow it
        last = plan.outer_sync.fragments - 1
        for name, param in out["params"].items():
            if param_fragment(name, plan.inputs.model.num_layers, plan.outer_sync.fragments) == last:
                assert_params(f"rank {rank} {name}", param, ref.params[name], max(group_inner_steps(plan)) * rounds)


@pytest.mark.slow
def test_two_fragments_match_the_staggered_reference(tmp_path: Path, pool: WorkerPool) -> None:
    plan = streamed(LAYOUT_A, GROUPS_A, fragments=2)
    outputs = run_rounds(plan, tmp_path, pool, (0, 2))
    assert_fragments_agree(outputs)
    check_streamed(plan, outputs, rounds=2)
    whole = streamed(LAYOUT_A, GROUPS_A)
    for rank, out in enumerate(outputs):
        assert [f for f, _, _ in out["syncs"]] == [0, 1, 0, 1]
        if rank == 0:  # it holds the whole model: each exchange moves a part of its bytes
            assert all(0 < sent < out["losses"][0][2] for _, sent, _ in out["syncs"][:2])
        assert out["losses"][0][2] == sum(sent for _, sent, _ in out["syncs"][:2]) == bucket_bytes(whole, rank, False)


@pytest.mark.slow
def test_two_fragments_resume_mid_way_under_another_layout(tmp_path: Path, pool: WorkerPool) -> None:
    plan_a, plan_b = streamed(LAYOUT_A, GROUPS_A, fragments=2), streamed(LAYOUT_B, GROUPS_B, fragments=2)
    saved = tmp_path / "ckpt"
    run_rounds(plan_a, tmp_path, pool, (0, 1), save=saved)
    found = ckpt.latest_checkpoint(saved)
    assert found is not None
    outputs = run_rounds(plan_b, tmp_path, pool, (1, 2), resume=found)
    check_streamed(plan_b, outputs, rounds=2, first=1)

"""Parity: a plan's run (several gloo processes on CPU, fp32) equals single-process training of the same model
from the same seed on the same global batches.

The plans change TP degree at stage boundaries 1 <-> 2, 2 -> 1, 4 -> 1 and 4 -> 3 (where each receiver of the lean
transfer takes several chunks). For each plan: the first step's gradients of every parameter (gathered to full
tensors on every rank that holds them) and the global losses of 3 optimizer steps match the reference within 1e-5
relative, with an absolute floor for the gradients justified in `grad_atol`; the parameters after 3 steps match
within the bound justified in `_assert_params`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flashflex_cli.model.spec import PRESETS, ModelSpec
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine
from flashflex_cli.runtime.training.optimizer import lr_at
from flashflex_cli.runtime.training.reference import reference_train
from tests.infra.worker_pool import WorkerPool, gloo_rank

STEPS = 3
SEED = 7
SEQ = 16
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, total_steps=10, weight_decay=0.1, grad_clip=1.0)
RTOL = 1e-5
FP32_EPS = torch.finfo(torch.float32).eps


def grad_atol(want: torch.Tensor, tokens: int) -> float:
    """Absolute floor for comparing one gradient tensor. Each element sums one term per token of the global
    batch, and the plan sums them in another order (per micro-batch, per pipeline, then across pipelines) than
    the reference. An element that nearly cancels to zero keeps the rounding of its terms, whose size is the
    tensor's scale, not the element's: fp32 summation error grows as eps * sqrt(terms) * term size. Floor:
    4 * eps * sqrt(tokens) * max|want| (observed worst on these plans: ~7e-7 * max|want|, 7x inside it)."""
    return 4.0 * FP32_EPS * tokens**0.5 * float(want.abs().max())


def make_plan(model: str | ModelSpec, pipelines: list[tuple[int, int, list[tuple[int, tuple[int, int]]]]],
              seq_len: int = SEQ, recompute: bool = False, dtype: str = "fp32") -> Plan:
    """A Plan from [(micro_batch_size, num_micro_batches, [(tp, (first_layer, end_layer)), ...]), ...]."""
    device = 0
    pipes: list[dict[str, Any]] = []
    for mbs, nmb, stages in pipelines:
        stage_dicts = []
        for tp, layers in stages:
            stage_dicts.append({"devices": [f"cpu0/{device + t}" for t in range(tp)], "tp": tp,
                                "layers": list(layers)})
            device += tp
        pipes.append({"micro_batch_size": mbs, "num_micro_batches": nmb, "stages": stage_dicts})
    batch = sum(mbs * nmb for mbs, nmb, _ in pipelines)
    return Plan.model_validate({
        "schema": "flashflex.plan/1",
        "inputs": {"cluster_sha256": "test", "model": (PRESETS[model] if isinstance(model, str) else model).model_dump(),
                   "train": {"global_batch": batch, "seq_len": seq_len, "dtype": dtype,
                             "recompute": recompute}},
        "pipelines": pipes,
    })


def make_batches(plan: Plan, steps: int = STEPS, seed: int = 1234) -> list[torch.Tensor]:
    """Random token batches int64 [global_batch, seq_len + 1], one per step."""
    train, vocab = plan.inputs.train, plan.inputs.model.vocab_size
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (train.global_batch, train.seq_len + 1), generator=gen) for _ in range(steps)]


def _worker(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, steps: tuple[int, int],
            resume: str) -> None:
    """Run optimizer steps [steps[0], steps[1]) of `plan` on `rank` (after loading full state from `resume`
    when given) and save losses, first-step full grads, final full params and full state to out_dir."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        groups = build_groups(plan, rank)
        engine = RankEngine(plan, rank, groups, torch.device("cpu"), OPTIM, seed=SEED if not resume else SEED + 1)
        if resume:
            state = torch.load(resume)
            engine.load_from_full(state.__getitem__)
        batches = make_batches(plan, steps=steps[1])
        results, grads = [], {}
        for step in range(*steps):
            rows = batches[step][engine.pipeline_slice(plan.inputs.train.global_batch)]
            result = engine.train_step(rows)
            results.append((result.loss, result.grad_norm, result.lr))
            if step == steps[0]:
                grads = engine.gather_full_grads()
        torch.save({"results": results, "grads": grads, "params": engine.gather_full_params(),
                    "state": engine.gather_full_state(), "step": engine.step}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """Seven reusable worker processes (the largest plan below has 7 ranks)."""
    with WorkerPool(7, _worker) as workers:
        yield workers


def run_plan(plan: Plan, tmp_path: Path, pool: WorkerPool, steps: tuple[int, int] = (0, STEPS),
             resume: Path | None = None) -> list[dict[str, Any]]:
    """Run steps [a, b) of `plan` on plan.world_size pooled processes (gloo); every rank's outputs."""
    out_dir = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
    out_dir.mkdir()
    pool.run([(rank, plan.world_size, plan.to_json(), str(out_dir / "store"), str(out_dir), steps,
               str(resume or "")) for rank in range(plan.world_size)])
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(plan.world_size)]


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs()
    bound = atol + rtol * want.abs()
    worst = float((err - bound).max())
    assert worst <= 0, f"{name}: max abs error {float(err.max()):.3e} exceeds rtol {rtol} atol {atol}"


def _assert_params(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Parameters after 3 AdamW steps. Adam divides the first moment by the root of the second, so an element
    whose gradient is near zero (comparable to the 1e-7 relative rounding of the summed gradients) takes a
    normalised step of about +-lr whose sign rounding can flip: such an element may differ by up to 2 lr per
    step. So: no element differs by more than 2 * sum(lr) over the steps, and all but a tiny fraction (< 0.1%)
    agree within 1e-5 relative plus 1e-6 absolute (1e-3 of the smallest step). Observed on these plans: max
    difference ~1.4e-6, fraction outside ~5e-6."""
    max_move = 2 * sum(lr_at(s, OPTIM) for s in range(STEPS))
    err = (got - want).abs()
    assert float(err.max()) <= max_move, f"{name}: differs by {float(err.max()):.3e} > {max_move:.3e}"
    bad = (err > 1e-6 + RTOL * want.abs()).float().mean().item()
    assert bad < 1e-3, f"{name}: {bad:.2%} of elements differ by more than 1e-6 + 1e-5 relative"


def check_parity(plan: Plan, tmp_path: Path, pool: WorkerPool) -> None:
    """Run `plan` and the reference; compare losses, first-step gradients and final parameters on every rank."""
    outputs = run_plan(plan, tmp_path, pool)
    ref = reference_train(plan.inputs.model, make_batches(plan), OPTIM, seed=SEED)
    seen: set[str] = set()
    for rank, out in enumerate(outputs):
        assert out["step"] == STEPS
        losses = torch.tensor([r[0] for r in out["results"]], dtype=torch.float64)
        _assert_close(f"rank {rank} losses", losses, torch.tensor(ref.losses, dtype=torch.float64), RTOL, 0.0)
        norms = torch.tensor([r[1] for r in out["results"]], dtype=torch.float64)
        _assert_close(f"rank {rank} grad norms", norms, torch.tensor(ref.grad_norms, dtype=torch.float64),
                      RTOL, 0.0)
        for name, grad in out["grads"].items():
            want = ref.grads[0][name]
            _assert_close(f"rank {rank} grad {name}", grad, want, RTOL,
                          grad_atol(want, plan.inputs.train.tokens_per_step))
            _assert_params(f"rank {rank} param {name}", out["params"][name], ref.params[name])
            seen.add(name)
    assert seen == set(ref.params), f"parameters never checked: {sorted(set(ref.params) - seen)}"
    # The loss must actually change across steps, or the comparison would be vacuous.
    assert ref.losses[0] != ref.losses[-1]


@pytest.mark.slow
def test_two_pipelines_tp2_vs_two_stages(tmp_path: Path, pool: WorkerPool) -> None:
    """(i) pipeline 0: one TP-2 stage with all layers; pipeline 1: two TP-1 stages splitting the layers."""
    plan = make_plan("llama-tiny", [(1, 2, [(2, (0, 4))]), (1, 3, [(1, (0, 1)), (1, (1, 4))])])
    check_parity(plan, tmp_path, pool)


@pytest.mark.slow
def test_one_pipeline_tp_2_1_2(tmp_path: Path, pool: WorkerPool) -> None:
    """(ii) one pipeline whose stages have TP 2, 1, 2 (TP changes at both boundaries)."""
    plan = make_plan("llama-tiny", [(2, 4, [(2, (0, 1)), (1, (1, 3)), (2, (3, 4))])])
    check_parity(plan, tmp_path, pool)


@pytest.mark.slow
def test_three_unlike_pipelines(tmp_path: Path, pool: WorkerPool) -> None:
    """(iii) three pipelines with different micro-batch sizes/counts and layer splits."""
    plan = make_plan("llama-tiny", [
        (2, 1, [(1, (0, 4))]),
        (1, 3, [(1, (0, 3)), (1, (3, 4))]),
        (1, 4, [(1, (0, 1)), (1, (1, 2)), (1, (2, 4))]),
    ])
    check_parity(plan, tmp_path, pool)


@pytest.mark.slow
def test_layer_at_tp1_and_tp2(tmp_path: Path, pool: WorkerPool) -> None:
    """(iv) layers held at TP 1 in one pipeline and TP 2 in the other, with different boundaries."""
    plan = make_plan("llama-tiny", [
        (1, 2, [(1, (0, 2)), (2, (2, 4))]),
        (1, 3, [(2, (0, 1)), (1, (1, 4))]),
    ])
    check_parity(plan, tmp_path, pool)


@pytest.mark.slow
def test_gqa_tp2(tmp_path: Path, pool: WorkerPool) -> None:
    """(v) grouped-query attention (4 query heads, 2 kv heads) at TP 2, next to a TP-1 pipeline."""
    plan = make_plan("llama-tiny-gqa", [(1, 2, [(2, (0, 4))]), (2, 2, [(1, (0, 2)), (2, (2, 4))])])
    check_parity(plan, tmp_path, pool)


@pytest.mark.slow
def test_tp4_to_tp1_to_tp2(tmp_path: Path, pool: WorkerPool) -> None:
    """TP 4 -> 1 -> 2 boundaries in one pipeline (7 ranks)."""
    plan = make_plan("llama-tiny", [(1, 3, [(4, (0, 1)), (1, (1, 2)), (2, (2, 4))])])
    check_parity(plan, tmp_path, pool)


# 12 heads of 8, a feed-forward of 192: shardable at TP 1, 2, 3 and 4
TINY12 = PRESETS["llama-tiny"].model_copy(update={"name": "tiny-tp12", "hidden_size": 96, "num_heads": 12,
                                                  "num_kv_heads": 12, "intermediate_size": 192})


@pytest.mark.slow
def test_tp4_to_tp3_receivers_take_several_chunks(tmp_path: Path, pool: WorkerPool) -> None:
    """A TP 4 -> 3 boundary (7 ranks): the lean transfer cuts the boundary tensor into lcm(4, 3) = 12 chunks, so
    each forward receiver takes 4 chunks (from all four senders) and each backward receiver 3, and every receiver
    all-gathers its chunks with its TP group's and must put them back in order (where a receiver takes one
    chunk, or its stage has TP 1, any order of the gathered chunks reads right). The vocabulary of 256 splits
    86/85/85 at TP 3."""
    plan = make_plan(TINY12, [(1, 3, [(4, (0, 2)), (3, (2, 4))])])
    check_parity(plan, tmp_path, pool)


@pytest.mark.slow
def test_uneven_vocabulary_shards(tmp_path: Path, pool: WorkerPool) -> None:
    """A vocabulary of 250 split 62/63/62/63 at TP 4 and 125/125 at TP 2 (embedding and head slices differ)."""
    spec = PRESETS["llama-tiny"].model_copy(update={"name": "tiny-v250", "vocab_size": 250})
    plan = make_plan(spec, [(1, 1, [(4, (0, 4))]), (1, 2, [(2, (0, 4))])])
    check_parity(plan, tmp_path, pool)


@pytest.mark.slow
def test_recompute_with_tp(tmp_path: Path, pool: WorkerPool) -> None:
    """Activation recomputation re-runs the TP collectives in backward; results are unchanged."""
    plan = make_plan("llama-tiny", [(1, 2, [(2, (0, 2)), (1, (2, 4))]), (1, 1, [(1, (0, 4))])], recompute=True)
    check_parity(plan, tmp_path, pool)


@pytest.mark.slow
def test_resume_under_another_plan(tmp_path: Path, pool: WorkerPool) -> None:
    """2 steps under plan A, full state saved, then step 3 under plan B (other pipelines, stages and TP degrees,
    other init seed overwritten by the load) equals 3 reference steps; replicas agree on the saved state."""
    plan_a = make_plan("llama-tiny", [(1, 2, [(2, (0, 4))]), (2, 1, [(1, (0, 4))])])
    plan_b = make_plan("llama-tiny", [(1, 4, [(1, (0, 2)), (2, (2, 4))])])
    state: dict[str, torch.Tensor] = {}
    for out in run_plan(plan_a, tmp_path, pool, steps=(0, 2)):
        for key, value in out["state"].items():
            if key in state:
                _assert_close(f"replicas of {key}", value, state[key], RTOL, 1e-9)
            state[key] = value
    assert int(state["step"]) == 2
    torch.save(state, tmp_path / "state.pt")
    outputs = run_plan(plan_b, tmp_path, pool, steps=(2, 3), resume=tmp_path / "state.pt")
    ref = reference_train(plan_a.inputs.model, make_batches(plan_a), OPTIM, seed=SEED)
    for rank, out in enumerate(outputs):
        assert out["step"] == 3
        loss, _, lr = out["results"][0]
        assert lr == lr_at(2, OPTIM)
        _assert_close(f"rank {rank} loss at step 3", torch.tensor([loss]), torch.tensor([ref.losses[2]]), RTOL, 0.0)
        for name, param in out["params"].items():
            _assert_params(f"rank {rank} param {name}", param, ref.params[name])


@pytest.mark.slow
def test_runs_are_bitwise_deterministic(tmp_path: Path, pool: WorkerPool) -> None:
    """The same plan, seed and batches give bit-identical losses and parameters on a second run."""
    plan = make_plan("llama-tiny", [(1, 2, [(2, (0, 2)), (1, (2, 4))]), (1, 2, [(1, (0, 4))])])
    first, second = run_plan(plan, tmp_path, pool), run_plan(plan, tmp_path, pool)
    for a, b in zip(first, second, strict=True):
        assert a["results"] == b["results"]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])

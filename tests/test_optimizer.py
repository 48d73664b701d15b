"""The optimizer is torch.optim.AdamW (fused or foreach): the same parameter groups and schedule, both kernels
the same update, and checkpoints written by the runtime's earlier hand-written AdamW resume onto the same
trajectory (tests/golden/adamw-ckpt, written by that version: tests/golden/make_adamw_checkpoint.py).

Tolerances: parameters after AdamW steps may differ by the rounding of the update (1e-6 relative) except where
a gradient element is near zero: Adam's normalised step there is about +-lr and its sign can follow rounding, so
such an element may move by up to 2 lr per step (the same bound as tests/test_parity.py, which observes it at
< 1e-5 of the elements); here every element must be within 2 * sum(lr) and all but 0.1% within 1e-6 relative
plus 1e-7 absolute.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.optimizer import OptimConfig, lr_at, make_optimizer
from flashflex_cli.semantics.runtime_paths import RuntimeOptions
from tests.golden import make_adamw_checkpoint as golden

GOLDEN = Path(__file__).parent / "golden" / "adamw-ckpt"


@pytest.fixture
def golden_plan(world_of_one: None) -> Plan:
    """The golden one-device plan, torch.distributed initialised for it."""
    return golden.plan()


def _engine(plan: Plan, optimizer: str, seed: int = golden.SEED) -> RankEngine:
    return RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), golden.OPTIM, seed=seed,
                      options=RuntimeOptions(optimizer=optimizer))  # type: ignore[arg-type]


def _assert_params(name: str, got: torch.Tensor, want: torch.Tensor, steps: list[int]) -> None:
    err = (got - want).abs()
    max_move = 2 * sum(lr_at(s, golden.OPTIM) for s in steps)
    assert float(err.max()) <= max_move, f"{name}: differs by {float(err.max()):.3e} > {max_move:.3e}"
    outside = (err > 1e-7 + 1e-6 * want.abs()).float().mean().item()
    assert outside < 1e-3, f"{name}: {outside:.2%} of elements differ by more than 1e-7 + 1e-6 relative"


def test_groups_decay_matrices_only_and_follow_the_schedule() -> None:
    params = [("w", torch.nn.Parameter(torch.ones(3, 2))), ("norm", torch.nn.Parameter(torch.ones(3))),
              ("e", torch.nn.Parameter(torch.ones(2, 2, 2)))]
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1)
    for path in ("fused", "foreach"):
        opt = make_optimizer(params, cfg, path)
        assert isinstance(opt, torch.optim.AdamW)
        decay, no_decay = opt.param_groups
        assert [id(p) for p in decay["params"]] == [id(params[0][1]), id(params[2][1])]
        assert [id(p) for p in no_decay["params"]] == [id(params[1][1])]
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
        assert decay["lr"] == lr_at(0, cfg) and decay["betas"] == cfg.betas and decay["eps"] == cfg.eps
        assert (decay["fused"], decay["foreach"]) == ((True, False) if path == "fused" else (False, True))
    with pytest.raises(ValueError, match="fused or foreach"):
        make_optimizer(params, cfg, "adam")


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_a_checkpoint_of_the_handwritten_adamw_resumes_on_its_trajectory(golden_plan: Plan,
                                                                         optimizer: str) -> None:
    """Resume step 2 of the old run (other init seed, overwritten by the load) and take its steps 3 and 4: the
    same losses and parameters. torch's per-parameter "step" is rebuilt from the checkpoint's step."""
    want = torch.load(GOLDEN / "continuation.pt")
    engine = _engine(golden_plan, optimizer, seed=golden.SEED + 1)
    found = ckpt.latest_checkpoint(GOLDEN)
    assert found is not None and found.name == "step-000002"
    engine.load_local(lambda targets: ckpt.load_into(found, targets))
    assert engine.step == golden.STEPS_BEFORE
    for param in engine.optimizer.param_groups[0]["params"]:
        step = engine.optimizer.state[param]["step"]
        assert float(step) == golden.STEPS_BEFORE and step.dtype == torch.float32 and step.device.type == "cpu"
    batches = golden.batches()
    losses = [engine.train_step(batch).loss for batch in batches[golden.STEPS_BEFORE:]]
    assert losses == pytest.approx(want["losses"], rel=1e-6)
    assert want["losses"][0] != want["losses"][-1]
    after = list(range(golden.STEPS_BEFORE, golden.STEPS_BEFORE + golden.STEPS_AFTER))
    params = engine.gather_full_params()
    assert set(params) == set(want["params"])
    for name, param in params.items():
        _assert_params(name, param, want["params"][name], after)
    # the saved state keeps its names and values: moments as they were, then one more step each
    state = engine.state_for_checkpoint()
    assert int(state["step"]) == golden.STEPS_BEFORE + golden.STEPS_AFTER
    assert {k for k in state if k.endswith((".exp_avg", ".exp_avg_sq"))} == \
        {f"{n}.{m}" for n in params for m in ("exp_avg", "exp_avg_sq")}


def test_fused_and_foreach_take_the_same_steps(golden_plan: Plan) -> None:
    batches = golden.batches()
    runs = {}
    for path in ("foreach", "fused"):
        engine = _engine(golden_plan, path)
        losses = [engine.train_step(batch).loss for batch in batches]
        runs[path] = (losses, engine.gather_full_params(), engine)
    assert runs["fused"][0] == pytest.approx(runs["foreach"][0], rel=1e-6)
    for name, param in runs["fused"][1].items():
        _assert_params(name, param, runs["foreach"][1][name], list(range(len(batches))))
    fused = runs["fused"][2].optimizer
    assert fused.defaults["fused"] and all(float(s["step"]) == len(batches) for s in fused.state.values())

"""Optimizer state sharded across unlike data-parallel replicas (semantics/optimizer_shards.py,
runtime/parallel/sharded_optimizer.py): the pieces tile every sharded slice in proportion to the plan's weights,
and an asymmetric plan (TP changes at stage boundaries, unlike pipelines, a tied embedding, unequal shard
weights) trains as it does unsharded and as one process, with the DP reduction overlapped or not, hierarchical
or flat.

Tolerances: those of tests/test_parity.py (fp32). Sharding changes which collective sums an element (a
reduce-scatter of a padded buffer instead of an all-reduce), not the set of terms, so losses, norms and
gradients stay within the 1e-5 relative / `grad_atol` bounds of the unsharded runs, and parameters within
`_assert_params`. The gradient norm is summed from per-piece squares in another grouping: fp64 accumulation of
fp32 partial norms, far inside 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.checkpoint import dcp as checkpoint
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.parallel.sharded_optimizer import ShardedGradSync
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.reference import reference_train
from flashflex_cli.semantics.optimizer_shards import plan_pieces, sharded_elements, split_proportional
from flashflex_cli.semantics.parameters import model_params
from flashflex_cli.semantics.process_groups import slice_holders
from flashflex_cli.semantics.runtime_paths import RuntimeOptions
from tests.infra.worker_pool import gloo_rank

from .test_grad_overlap import STEPS as DP_STEPS
from .test_grad_overlap import TIED, DPPool, assert_matches_reference, assert_same_runs
from .test_hier_reduce import on_nodes
from .test_parity import (
    OPTIM,
    SEED,
    STEPS,
    WorkerPool,
    _assert_params,
    _worker,
    make_batches,
    make_plan,
    run_plan,
)

# TP 2 -> 1 against 1 -> 2 with another split, a tied embedding (both ends of each pipeline hold it)
ASYMMETRIC = [(1, 2, [(2, (0, 2)), (1, (2, 4))]), (1, 3, [(1, (0, 1)), (2, (1, 4))])]
WEIGHTS = [3, 1, 2, 1, 2, 5]


def sharded(plan: Plan, weights: list[int] | None = None) -> Plan:
    """`plan` with its optimizer state sharded (`weights` per rank; None: equal)."""
    data = plan.model_dump(mode="json", by_alias=True)
    data["optimizer_sharding"] = {"weights": weights[:plan.world_size]} if weights else {}
    return Plan.model_validate(data)


def test_split_proportional_tiles() -> None:
    assert split_proportional(10, [1, 1]) == [(0, 5), (5, 10)]
    assert split_proportional(10, [3, 1, 1]) == [(0, 6), (6, 8), (8, 10)]
    assert split_proportional(1, [1, 1, 1]) == [(0, 0), (0, 0), (0, 1)]
    for length in range(0, 40, 7):
        ranges = split_proportional(length, [5, 2, 9, 1])
        assert ranges[0][0] == 0 and ranges[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))


def test_pieces_tile_every_sharded_slice_once() -> None:
    plan = sharded(make_plan(TIED, ASYMMETRIC), WEIGHTS)
    slices = slice_holders(plan)
    shapes = {info.name: info.shape for info in model_params(plan.inputs.model)}
    pieces = plan_pieces(plan)
    assert pieces and plan_pieces(make_plan(TIED, ASYMMETRIC)) == []
    for index, sl in enumerate(slices):
        mine = [p for p in pieces if p.slice_index == index]
        if not sl.needs_reduce:
            assert not mine
            continue
        assert [p.rank for p in mine] == list(sl.ranks)
        whole = 1
        for size in (shapes[sl.name] if sl.dim is None else
                     [s if d != sl.dim else sl.stop - sl.start for d, s in enumerate(shapes[sl.name])]):
            whole *= size
        assert sum(p.numel for p in mine) == whole
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:], strict=False))
    saved = sharded_elements(plan)
    assert all(s >= 0 for s in saved) and sum(saved) > 0
    # a heavier rank keeps more: rank 5 (weight 5) and rank 1 (weight 1) share holder sets
    own = [sum(p.numel for p in pieces if p.rank == r) for r in range(plan.world_size)]
    assert own[5] > own[1]


def test_old_plans_load_unsharded_and_rewrite_byte_identical() -> None:
    plan = make_plan(TIED, ASYMMETRIC)
    text = plan.to_json()
    assert "optimizer_sharding" not in text
    assert Plan.model_validate_json(text).to_json() == text
    again = sharded(plan, WEIGHTS)
    assert Plan.model_validate_json(again.to_json()).to_json() == again.to_json()
    with pytest.raises(ValueError, match="optimizer_sharding.weights has 2 entries"):
        sharded(plan, [1, 2])
    with pytest.raises(ValueError, match="at least 1"):
        sharded(plan, [0, 1, 1, 1, 1, 1])


@pytest.fixture(scope="module")
def dp_pool() -> Iterator[DPPool]:
    """Six reusable worker processes."""
    with DPPool(6) as pool:
        yield pool


@pytest.mark.slow
def test_sharded_overlap_on_off_hierarchical_match_unsharded(tmp_path: Path, dp_pool: DPPool) -> None:
    """Losses, norms and first-step gradients: sharded (overlap on, off, hierarchical) == unsharded ==
    reference."""
    plain = make_plan(TIED, ASYMMETRIC)
    plan = sharded(plain, WEIGHTS)
    flat = {"overlap_dp": False, "hierarchical_dp": False}
    off = dp_pool.run_plan(plan, tmp_path, flat)
    on = dp_pool.run_plan(plan, tmp_path, {"overlap_dp": True, "hierarchical_dp": False})
    unsharded = dp_pool.run_plan(plain, tmp_path, flat)
    assert_matches_reference(plan, off)
    assert_matches_reference(plan, on)
    assert_same_runs(off, unsharded, plan)
    assert_same_runs(on, unsharded, plan)
    # holders on two nodes (the hierarchical fallback: all-reduce of the padded buffer, own chunk kept)
    nodes = on_nodes(plan, ["n0/0", "n1/0", "n0/1", "n0/2", "n1/1", "n1/2"])
    hier = dp_pool.run_plan(nodes, tmp_path, {"overlap_dp": True, "hierarchical_dp": True})
    assert any(out["hier_sets"] for out in hier)
    assert_matches_reference(nodes, hier)
    assert DP_STEPS >= 2


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """Six reusable worker processes."""
    with WorkerPool(6, _worker) as workers:
        yield workers


@pytest.mark.slow
def test_sharded_final_weights_match_reference(tmp_path: Path, pool: WorkerPool) -> None:
    """Three AdamW steps (warm-up, clipping at 1.0, weight decay): every rank's final parameters equal the
    one-process run's, and the gathered moments agree across replicas."""
    plan = sharded(make_plan("llama-tiny", [(1, 2, [(2, (0, 2)), (1, (2, 4))]), (1, 3, [(1, (0, 1)), (2, (1, 4))])]),
                   WEIGHTS)
    outputs = run_plan(plan, tmp_path, pool)
    ref = reference_train(plan.inputs.model, make_batches(plan), OPTIM, seed=SEED)
    for rank, out in enumerate(outputs):
        assert out["step"] == STEPS
        for name, param in out["params"].items():
            _assert_params(f"rank {rank} param {name}", param, ref.params[name])
        for key, value in out["state"].items():
            for other in outputs[:rank]:
                if key in other["state"]:
                    torch.testing.assert_close(value, other["state"][key], rtol=1e-5, atol=1e-9)


@pytest.mark.slow
def test_resume_sharded_and_unsharded_across_plans(tmp_path: Path, pool: WorkerPool) -> None:
    """2 steps sharded under plan A, its full state (the holders' pieces gathered) resumed by plan B unsharded,
    and the other way round: step 3 equals the reference's in both directions."""
    plan_a = make_plan("llama-tiny", [(1, 2, [(2, (0, 4))]), (2, 1, [(1, (0, 4))])])
    plan_b = make_plan("llama-tiny", [(1, 2, [(1, (0, 2)), (2, (2, 4))]), (1, 2, [(1, (0, 4))])])
    ref = reference_train(plan_a.inputs.model, make_batches(plan_a), OPTIM, seed=SEED)
    for first, second in ((sharded(plan_a, [1, 2, 4]), plan_b), (plan_a, sharded(plan_b, None))):
        state: dict[str, torch.Tensor] = {}
        for out in run_plan(first, tmp_path, pool, steps=(0, 2)):
            state.update(out["state"])
        path = tmp_path / f"state-{len(list(tmp_path.glob('state-*')))}.pt"
        torch.save(state, path)
        for rank, out in enumerate(run_plan(second, tmp_path, pool, steps=(2, 3), resume=path)):
            loss = out["results"][0][0]
            assert abs(loss - ref.losses[2]) <= 1e-5 * abs(ref.losses[2]), f"rank {rank}: {loss} != {ref.losses[2]}"
            for name, param in out["params"].items():
                _assert_params(f"rank {rank} param {name}", param, ref.params[name])


def dcp_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, root: str,
            steps: tuple[int, int]) -> None:
    """Resume from the newest DCP checkpoint in `root` when there is one (each rank reads its own slices and
    pieces), run steps [a, b), save a DCP checkpoint there; write the results and full parameters."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OPTIM, seed=SEED + steps[0])
        found = checkpoint.latest_checkpoint(root)
        if found is not None:
            engine.load_local(lambda targets: checkpoint.load_into(found, targets))
        batches = make_batches(plan, steps=steps[1])
        results = [engine.train_step(batches[step][engine.pipeline_slice(plan.inputs.train.global_batch)]).loss
                   for step in range(*steps)]
        checkpoint.save(root, engine.step, engine.state_for_checkpoint(), engine.checkpoint_shards(), {})
        torch.save({"losses": results, "params": engine.gather_full_params()}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_dcp_saves_pieces_and_resumes_under_other_plans(tmp_path: Path) -> None:
    """Sharded plan A saves DCP (each moment piece once, by its holder); unsharded plan B resumes it and saves;
    sharded plan C (other weights, other split) resumes that: steps 3 and 4 equal the reference's."""
    plan_a = sharded(make_plan("llama-tiny", [(1, 2, [(2, (0, 4))]), (2, 1, [(1, (0, 4))])]), [1, 2, 4])
    plan_b = make_plan("llama-tiny", [(1, 2, [(1, (0, 2)), (2, (2, 4))]), (1, 2, [(1, (0, 4))])])
    plan_c = sharded(make_plan("llama-tiny", [(1, 2, [(1, (0, 3)), (1, (3, 4))]), (1, 2, [(2, (0, 4))])]),
                     [5, 1, 1, 2])
    ref = reference_train(plan_a.inputs.model, make_batches(plan_a, steps=4), OPTIM, seed=SEED)
    root = tmp_path / "ckpt"
    manifest_seen = False
    with WorkerPool(4, dcp_job) as workers:
        for plan, steps in ((plan_a, (0, 2)), (plan_b, (2, 3)), (plan_c, (3, 4))):
            out = tmp_path / f"run-{steps[0]}"
            out.mkdir()
            workers.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out), str(root), steps)
                         for rank in range(plan.world_size)])
            if not manifest_seen:  # plan A's checkpoint holds the moments as pieces along one dim each
                table = checkpoint.read_manifest(checkpoint.latest_checkpoint(root))["tensors"]
                shards = table["layers.0.attn.wq.exp_avg"]["shards"]
                assert len(shards) > 1 and all(dim == 0 for dim, _, _ in shards)
                manifest_seen = True
            for rank in range(plan.world_size):
                got = torch.load(out / f"rank{rank}.pt")
                for step, loss in zip(range(*steps), got["losses"], strict=True):
                    assert abs(loss - ref.losses[step]) <= 1e-5 * abs(ref.losses[step]), (rank, step)
    for name, param in got["params"].items():
        want = ref.params[name]
        err = (param - want).abs()
        assert float(err.max()) <= 2 * sum(OPTIM.lr for _ in range(4)), name
        assert (err > 1e-6 + 1e-5 * want.abs()).float().mean().item() < 1e-3, name


def fp16_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str) -> None:
    """3 fp16 steps, rank 2's first optimizer gradient made inf at step 1; save each step's loss, norm, scale and
    whether it was skipped, and the final parameters."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OPTIM, seed=SEED,
                            overflow_steps=(1,) if rank == 2 else ())
        batches = make_batches(plan)
        results = []
        for step in range(STEPS):
            result = engine.train_step(batches[step][engine.pipeline_slice(plan.inputs.train.global_batch)])
            results.append((result.loss, result.grad_norm, result.loss_scale, result.skipped))
        torch.save({"results": results, "params": engine.gather_full_params()}, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_fp16_scaling_sees_the_sharded_gradients(tmp_path: Path) -> None:
    """fp16: an overflow on one rank's piece skips the step on every rank and backs the scale off, as unsharded;
    losses and final parameters match the unsharded run (fp16 compute: 1e-3 relative, the autocast rounding of
    the same operations; the reductions differ only in grouping)."""
    plain = make_plan("llama-tiny", ASYMMETRIC, dtype="fp16")
    runs = []
    with WorkerPool(6, fp16_job) as workers:
        for plan in (plain, sharded(plain, WEIGHTS)):
            out = tmp_path / f"run-{len(runs)}"
            out.mkdir()
            workers.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out))
                         for rank in range(plan.world_size)])
            runs.append([torch.load(out / f"rank{rank}.pt") for rank in range(plan.world_size)])
    for unsharded, shard in zip(*runs, strict=True):
        assert [r[3] for r in shard["results"]] == [False, True, False]
        assert [r[2] for r in shard["results"]] == [r[2] for r in unsharded["results"]]
        for (loss_a, *_), (loss_b, *_) in zip(shard["results"], unsharded["results"], strict=True):
            assert abs(loss_a - loss_b) <= 1e-3 * abs(loss_b)
        for name, param in shard["params"].items():
            torch.testing.assert_close(param, unsharded["params"][name], rtol=1e-3, atol=1e-4)


# two stages (a tied embedding at both ends) beside one stage of every layer: every layer is sharded
OVERLAP_PLAN = [(1, 2, [(1, (0, 2)), (1, (2, 4))]), (2, 1, [(1, (0, 4))])]


def gather_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, overlap_dp: bool,
               synchronous: bool, compile_scope: str = "") -> None:
    """STEPS steps; `synchronous`: land the parameter gathers right after each step (as a blocking gather
    would), else leave them to the next forward; `compile_scope`: compiled (dynamo with the eager backend) per
    block or whole. Saves the losses, what was in flight after each step and (uncompiled) at the first forward
    of layers 0 and 1, the parameters as the step left them and as a checkpoint (taken with no explicit wait)
    reads them."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        compiled = {"compile": True, "compile_scope": compile_scope} if compile_scope else {}
        engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OPTIM, seed=SEED,
                            options=RuntimeOptions(overlap_dp=overlap_dp, hierarchical_dp=False, **compiled),
                            compile_backend="eager")
        sync = engine.sync

        def pending() -> frozenset[str]:
            return sync.pending_parameters if isinstance(sync, ShardedGradSync) else frozenset()

        low = engine.stage_plan.layers[0]
        first, second = (frozenset(name for name in engine.params if name.startswith(f"layers.{layer}."))
                         for layer in (low, low + 1))
        at_first_layer: list[tuple[bool, bool]] = []  # per forward of layer 0: (its own, layer 1's) in flight

        def probe(*_: object) -> None:  # registered after the engine's hooks: runs after them
            at_first_layer.append((bool(pending() & first), bool(pending() & second)))

        if not compile_scope:
            engine.module.layers[0].register_forward_pre_hook(probe)
        batches = make_batches(plan)
        losses, in_flight = [], []
        left: dict[str, torch.Tensor] = {}
        for step in range(STEPS):
            losses.append(engine.train_step(batches[step][engine.pipeline_slice(plan.inputs.train.global_batch)]).loss)
            in_flight.append(sorted(pending()))
            left = {name: param.detach().clone() for name, (_, param) in engine.params.items()}
            if synchronous:
                engine.wait_for_parameters()
        saved = {name: value.clone() for name, value in engine.state_for_checkpoint().items() if name in engine.params}
        torch.save({"losses": losses, "in_flight": in_flight, "at_first_layer": at_first_layer, "left": left,
                    "saved": saved,
                    "compiled": (engine.options.compile, engine.module.runners.whole is not None),
                    "sharded": sorted(sync.sharded) if isinstance(sync, ShardedGradSync) else [], "params": engine.gather_full_params()},
                   Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.slow
def test_parameter_gathers_overlap_the_next_forward(tmp_path: Path) -> None:
    """The update's gathers are still in flight when the step returns; the next forward lands each layer's just
    before that layer runs (layer 1's still in flight while layer 0 starts); a checkpoint after a step reads the
    landed weights. Losses and final weights are those of the gathers landed at once (bit for bit) and of the
    unsharded run (the parity bounds), with the DP reduction overlapped or not."""
    plain = make_plan(TIED, OVERLAP_PLAN)
    plan = sharded(plain, [1, 2, 4])
    ref = reference_train(plan.inputs.model, make_batches(plan), OPTIM, seed=SEED)

    def run(which: Plan, overlap_dp: bool, synchronous: bool) -> list[dict]:
        out = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
        out.mkdir()
        workers.run([(rank, which.world_size, which.to_json(), str(out / "store"), str(out), overlap_dp,
                      synchronous) for rank in range(which.world_size)])
        return [torch.load(out / f"rank{rank}.pt") for rank in range(which.world_size)]

    with WorkerPool(3, gather_job) as workers:
        for overlap_dp in (False, True):
            deferred, landed = run(plan, overlap_dp, False), run(plan, overlap_dp, True)
            for rank, (mine, theirs) in enumerate(zip(deferred, landed, strict=True)):
                assert mine["sharded"] and all(step == mine["sharded"] for step in mine["in_flight"]), rank
                assert mine["losses"] == theirs["losses"]
                for name, value in mine["saved"].items():
                    assert torch.equal(value, theirs["saved"][name]), (rank, name)  # the checkpoint waited
                assert any(not torch.equal(mine["left"][name], mine["saved"][name]) for name in mine["sharded"])
                # steps after the first: layer 0 runs with its own gathers landed, layer 1's still in flight
                assert mine["at_first_layer"][:1] == [(False, False)]
                assert (False, True) in mine["at_first_layer"][1:] and (True, False) not in mine["at_first_layer"]
                assert set(theirs["at_first_layer"]) == {(False, False)}
                for name, param in mine["params"].items():
                    assert torch.equal(param, theirs["params"][name])
                    _assert_params(f"rank {rank} param {name}", param, ref.params[name])
                for step, loss in enumerate(mine["losses"]):
                    assert abs(loss - ref.losses[step]) <= 1e-5 * abs(ref.losses[step]), (rank, step)
        for rank, (mine, unsharded) in enumerate(zip(deferred, run(plain, True, True), strict=True)):
            for a, b in zip(mine["losses"], unsharded["losses"], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), rank
            for name, param in mine["params"].items():
                _assert_params(f"rank {rank} param {name} (unsharded)", param, unsharded["params"][name])


@pytest.mark.slow
@pytest.mark.parametrize("scope", ["block", "stage"])
def test_parameter_gathers_land_under_compile(tmp_path: Path, scope: str) -> None:
    """Compiled per block (the layers' hooks run outside the graphs) or whole (the stage's hook lands every
    gather before the graph): the gathers are in flight after each step, and losses and final weights equal the
    uncompiled run's with the gathers landed at once."""
    plan = sharded(make_plan(TIED, OVERLAP_PLAN), [1, 2, 4])
    runs = []
    with WorkerPool(3, gather_job) as workers:
        for synchronous, compile_scope in ((True, ""), (False, scope)):
            out = tmp_path / f"run-{len(runs)}"
            out.mkdir()
            workers.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out), True, synchronous,
                          compile_scope) for rank in range(plan.world_size)])
            runs.append([torch.load(out / f"rank{rank}.pt") for rank in range(plan.world_size)])
    for rank, (landed, mine) in enumerate(zip(*runs, strict=True)):
        assert mine["compiled"] == (True, scope == "stage")
        assert mine["sharded"] and all(step == mine["sharded"] for step in mine["in_flight"]), rank
        for a, b in zip(mine["losses"], landed["losses"], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), rank
        for name, param in mine["params"].items():
            torch.testing.assert_close(param, landed["params"][name], rtol=1e-6, atol=1e-7)

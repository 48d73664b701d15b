"""Single-process checks of the runtime's plan-derived structure: 1F1B order, stage-boundary neighbours,
data-parallel slices, shard ownership, the optimizer and LR schedule, slowdown, the GQA plan rule."""

from __future__ import annotations

import math
import time

import pytest
import torch
from pydantic import ValidationError

from flashflex_cli.errors import InputError
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.runtime.device.slowdown import Slowdown
from flashflex_cli.runtime.parallel.groups import neighbours, slice_holders
from flashflex_cli.runtime.training.engine import plan_shard_specs
from flashflex_cli.runtime.training.optimizer import OptimConfig, lr_at, make_optimizer, set_lr
from flashflex_cli.semantics.schedule import one_f_one_b
from tests.test_parity import make_plan


def _simulate(num_stages: int, num_micro: int) -> int:
    """Run every stage's op list with blocking receives and non-blocking sends; returns the peak number of
    micro-batches whose activations a stage holds. Fails on a deadlock."""
    ops = [one_f_one_b(num_stages, s, num_micro) for s in range(num_stages)]
    done: list[set[tuple[str, int]]] = [set() for _ in range(num_stages)]
    pos = [0] * num_stages
    peak = 0
    while any(pos[s] < len(ops[s]) for s in range(num_stages)):
        progressed = False
        for s in range(num_stages):
            if pos[s] == len(ops[s]):
                continue
            kind, i = ops[s][pos[s]]
            if kind == "F" and s > 0 and ("F", i) not in done[s - 1]:
                continue
            if kind == "B" and s < num_stages - 1 and ("B", i) not in done[s + 1]:
                continue
            done[s].add((kind, i))
            pos[s] += 1
            progressed = True
            held = sum(1 for k, _ in done[s] if k == "F") - sum(1 for k, _ in done[s] if k == "B")
            peak = max(peak, held)
        assert progressed, f"deadlock with {num_stages} stages, {num_micro} micro-batches at {pos}"
    return peak


@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (1, 4), (2, 2), (3, 3), (3, 7), (4, 4), (4, 9)])
def test_1f1b_is_complete_ordered_and_deadlock_free(stages: int, micro: int) -> None:
    for s in range(stages):
        ops = one_f_one_b(stages, s, micro)
        assert sorted(ops) == sorted([("F", i) for i in range(micro)] + [("B", i) for i in range(micro)])
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(micro))
        assert [i for k, i in ops if k == "B"] == list(range(micro))
    assert _simulate(stages, micro) == min(stages, micro)


def test_first_stage_warmup_then_alternates() -> None:
    assert one_f_one_b(3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2),
                                    ("B", 3)]
    assert one_f_one_b(3, 2, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_boundary_neighbours_when_tp_changes() -> None:
    # ranks: stage 0 TP4 = 0..3, stage 1 TP1 = 4, stage 2 TP2 = 5, 6
    plan = make_plan("llama-tiny", [(1, 3, [(4, (0, 1)), (1, (1, 2)), (2, (2, 4))])])
    assert neighbours(plan, 0) == (None, (4,), 4, ())
    assert neighbours(plan, 3) == (None, (), 4, ())  # sender 3 gets the gradient, sends no activation
    assert neighbours(plan, 4) == (0, (5, 6), 5, (0, 1, 2, 3))
    assert neighbours(plan, 5) == (4, (), None, (4,))
    assert neighbours(plan, 6) == (4, (), None, ())
    # TP 1 -> 2 -> 1 in another layout
    plan = make_plan("llama-tiny", [(1, 3, [(1, (0, 1)), (2, (1, 2)), (1, (2, 4))])])
    assert neighbours(plan, 1) == (0, (3,), 3, (0,)) and neighbours(plan, 2) == (0, (), 3, ())


def test_slices_split_at_every_holders_boundary() -> None:
    # pipeline 0: ranks 0 (TP1, layers 0-1), 1, 2 (TP2, layers 2-3); pipeline 1: 3, 4 (TP2, layer 0), 5 (TP1)
    plan = make_plan("llama-tiny", [(1, 2, [(1, (0, 2)), (2, (2, 4))]), (1, 3, [(2, (0, 1)), (1, (1, 4))])])
    by_name: dict[str, list] = {}
    for sl in slice_holders(plan):
        by_name.setdefault(sl.name, []).append(sl)
    wq0 = by_name["layers.0.attn.wq"]
    assert [(s.start, s.stop, s.ranks, s.contributors) for s in wq0] == [(0, 32, (0, 3), (0, 3)),
                                                                         (32, 64, (0, 4), (0, 4))]
    wo3 = by_name["layers.3.attn.wo"]
    assert [(s.dim, s.start, s.stop, s.ranks) for s in wo3] == [(1, 0, 32, (1, 5)), (1, 32, 64, (2, 5))]
    norm0 = by_name["layers.0.attn_norm"]
    assert [(s.ranks, s.contributors) for s in norm0] == [((0, 3, 4), (0, 3))]  # one contribution per pipeline
    head = by_name["head"]
    assert [(s.start, s.stop, s.ranks) for s in head] == [(0, 128, (1, 5)), (128, 256, (2, 5))]
    single = make_plan("llama-tiny", [(1, 2, [(2, (0, 4))])])
    assert not any(sl.needs_reduce for sl in slice_holders(single))


def test_shard_owner_is_unique_and_pipelines_cover_every_parameter() -> None:
    plan = make_plan("llama-tiny", [(1, 2, [(1, (0, 2)), (2, (2, 4))]), (1, 3, [(2, (0, 1)), (1, (1, 4))])])
    owners: dict[tuple, int] = {}
    coverage: dict[tuple[int, str], int] = {}
    for info in plan.ranks():
        for spec in plan_shard_specs(plan, info.rank):
            key = (spec.name, spec.dim, spec.start, spec.stop)
            owners[key] = owners.get(key, 0) + int(spec.owner)
            size = math.prod(spec.full_shape) if spec.dim is None else (
                math.prod(spec.full_shape) // spec.full_shape[spec.dim] * (spec.stop - spec.start))
            if spec.dim is not None or info.tp_rank == 0:
                coverage[(info.pipeline, spec.name)] = coverage.get((info.pipeline, spec.name), 0) + size
    assert set(owners.values()) == {1}
    totals = {name: math.prod(shape) for name, shape in
              ((s.name, s.full_shape) for r in plan.ranks() for s in plan_shard_specs(plan, r.rank))}
    for (_, name), size in coverage.items():
        assert size == totals[name], name
    assert len({name for _, name in coverage}) == 3 + 9 * 4


def test_lr_warmup_then_cosine() -> None:
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=4, total_steps=14)
    assert [lr_at(s, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(4, cfg) == pytest.approx(1e-3)
    assert lr_at(9, cfg) == pytest.approx(5.5e-4)
    assert lr_at(14, cfg) == pytest.approx(1e-4) and lr_at(100, cfg) == pytest.approx(1e-4)
    decay = [lr_at(s, cfg) for s in range(4, 15)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    with pytest.raises(InputError):
        OptimConfig(lr=1e-4, min_lr=1e-3)


@pytest.mark.parametrize("path", ["foreach", "fused"])
def test_adamw_matches_torch(path: str) -> None:
    """make_optimizer's groups (decay on the matrix only) and the schedule, against torch's single-tensor
    AdamW given the groups by hand."""
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, total_steps=6, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)), torch.nn.Parameter(torch.randn(3, generator=gen))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = make_optimizer([("w", ours[0]), ("n", ours[1])], cfg, path)
    ref = torch.optim.AdamW([{"params": [theirs[0]], "weight_decay": 0.1}, {"params": [theirs[1]],
                                                                           "weight_decay": 0.0}],
                            lr=1.0, betas=cfg.betas, eps=cfg.eps, foreach=False)
    for step in range(5):
        grads = [torch.randn(p.shape, generator=gen) for p in ours]
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        set_lr(opt, lr_at(step, cfg))
        set_lr(ref, lr_at(step, cfg))
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7)
    assert all(float(opt.state[p]["step"]) == 5 for p in ours) and not torch.equal(ours[0], theirs[0].detach() * 0)


class FakeClock:
    """A clock that advances only when told (seconds), so slowdown arithmetic is checked without wall time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.queued = 0.0
        self.comm = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def slowdown(self, factor: float) -> Slowdown:
        return Slowdown(factor, comm_clock=lambda: self.comm, clock=lambda: self.now, sleep=self.sleep,
                        queue_clock=lambda: self.queued)


def test_slowdown_stretches_compute() -> None:
    clock = FakeClock()
    slow = clock.slowdown(3.0)
    with slow.op():
        clock.now += 0.05  # 50 ms of compute
    assert clock.slept == [pytest.approx(0.10)] and slow.slept == pytest.approx(0.10)
    assert clock.now == pytest.approx(0.15)  # the op lasted 3x its compute
    with pytest.raises(InputError):
        Slowdown(0.5)


def test_slowdown_sleeps_for_real() -> None:
    # no run-queue delay counted: on a loaded host it may absorb the whole stretch (see runtime/device/slowdown.py)
    slow = Slowdown(2.0, queue_clock=lambda: 0.0)
    with slow.op():
        busy_until = time.perf_counter() + 0.01
        while time.perf_counter() < busy_until:
            pass
    assert slow.slept > 0.0  # the default clock and sleep are wired; durations are checked with FakeClock


def test_slowdown_absorbs_run_queue_delay() -> None:
    """Time spent waiting for a host core (more emulated devices than cores) is not stretched by the slowdown:
    the op lasts factor x its on-core compute, with the queueing delay absorbed by the sleep."""
    clock = FakeClock()
    slow = clock.slowdown(3.0)
    with slow.op():
        clock.now += 0.05
        clock.queued += 0.03  # 30 ms of the op were spent runnable, waiting for a core
    compute = 0.05 - 0.03
    assert slow.slept == pytest.approx(2.0 * compute - 0.03)
    assert clock.now == pytest.approx(3.0 * compute)  # the contention was not multiplied


def test_slowdown_leaves_communication_out() -> None:
    clock = FakeClock()
    slow = clock.slowdown(2.0)
    with slow.op():
        clock.now += 0.04
        clock.comm += 0.03  # 30 ms of the op were a collective
    assert slow.slept == pytest.approx(0.01)


def test_plan_rejects_tp_not_dividing_kv_heads(tmp_path) -> None:
    with pytest.raises(ValidationError, match="tp 4 must divide num_heads 4, num_kv_heads 2"):
        make_plan("llama-tiny-gqa", [(1, 1, [(4, (0, 4))])])
    plan = make_plan("llama-tiny-gqa", [(1, 1, [(2, (0, 4))])])
    text = plan.to_json().replace('"tp": 2', '"tp": 4').replace('"cpu0/1"', '"cpu0/1", "cpu0/2", "cpu0/3"')
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(InputError, match=r"pipelines\.0\.stages\.0.*num_kv_heads 2") as err:
        load_plan(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("stages", "micro"), [(2, 2), (2, 5), (3, 3), (3, 8), (4, 4), (5, 11)])
def test_batched_exchanges_pair_up_between_neighbours(stages: int, micro: int) -> None:
    """Stage s sends activation j and receives gradient i in one batch exactly when stage s + 1 sends gradient
    i and receives activation j in one batch (what the runner relies on to batch P2P)."""

    def pairs(s: int, first: str, second: str) -> set[tuple[int, int]]:
        ops = one_f_one_b(stages, s, micro)
        return {(a[1], b[1]) for a, b in zip(ops, ops[1:], strict=False) if (a[0], b[0]) == (first, second)}

    for s in range(stages - 1):
        fwd_then_bwd = pairs(s, "F", "B")  # (activation sent, gradient received)
        bwd_then_fwd = {(j, i) for i, j in pairs(s + 1, "B", "F")}  # (activation received, gradient sent)
        assert fwd_then_bwd == bwd_then_fwd
        assert fwd_then_bwd or micro <= stages - s - 1


def _numel(shape: tuple[int, ...], dim: int | None, start: int, stop: int) -> int:
    """Elements of the slice [start, stop) along `dim` of a tensor of `shape` (the whole tensor for None)."""
    return math.prod(shape) if dim is None else math.prod(shape) // shape[dim] * (stop - start)


def test_each_rank_reduces_exactly_its_own_shards() -> None:
    """No rank moves more than it holds: the slices a rank all-reduces add up to its local shard sizes (no
    gathering of whole replicas), and every slice of a shared parameter is reduced."""
    plan = make_plan("llama-tiny", [(1, 2, [(1, (0, 2)), (2, (2, 4))]), (1, 3, [(2, (0, 1)), (1, (1, 4))])])
    slices = slice_holders(plan)
    for info in plan.ranks():
        specs = plan_shard_specs(plan, info.rank)
        shapes = {s.name: s.full_shape for s in specs}
        local = sum(_numel(s.full_shape, s.dim, s.start, s.stop) for s in specs)
        reduced = sum(_numel(shapes[sl.name], sl.dim, sl.start, sl.stop) for sl in slices
                      if info.rank in sl.ranks and sl.needs_reduce)
        assert reduced == local, info  # both pipelines hold every parameter here


def test_gpu_ranks_share_the_host_cores_between_local_ranks() -> None:
    from flashflex_cli.runtime.training.worker import gpu_rank_threads

    assert gpu_rank_threads(4, cores=16) == 4
    assert gpu_rank_threads(4, cores=2) == 1
    assert gpu_rank_threads(1, cores=2) == 2

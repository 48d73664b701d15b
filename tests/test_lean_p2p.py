"""Lean stage-boundary transfers (RuntimeOptions.lean_p2p): the chunk plan covers every element exactly once
for any pair of TP degrees, and real multi-process gloo runs across boundaries 2->2, 1->2, 2->1 and 2->3 (whose
backward crosses 3->2) train exactly like the full transfers and like one device, while each sending rank puts
only 1/t of the tensor on the wire. Also the step timer (OpTimer: CUDA events read once at the end, perf_counter
on CPU) and how PipelineTimes adds up its marks."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from flashflex_cli.cost.comm import transfer_element_bytes
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.device import op_timer
from flashflex_cli.runtime.device.op_timer import OpTimer
from flashflex_cli.runtime.parallel.groups import adjacent_stages, build_groups, stage_ranks
from flashflex_cli.runtime.parallel.pipeline import PipelineTimes
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.reference import reference_train
from flashflex_cli.semantics.boundary import ChunkPlan
from flashflex_cli.semantics.runtime_paths import RuntimeOptions
from tests.infra.worker_pool import WorkerPool, gloo_rank

from .test_parity import (
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

# 6 heads of 8, a feed-forward of 144: shardable at TP 1, 2 and 3
TINY3 = PRESETS["llama-tiny"].model_copy(update={"name": "tiny-tp3", "hidden_size": 48, "num_heads": 6,
                                                 "num_kv_heads": 6, "intermediate_size": 144})

PLANS: dict[str, Plan] = {
    "2->2": make_plan("llama-tiny", [(1, 3, [(2, (0, 2)), (2, (2, 4))])]),
    "1->2->1": make_plan("llama-tiny", [(2, 2, [(1, (0, 1)), (2, (1, 3)), (1, (3, 4))])]),
    "2->3": make_plan(TINY3, [(1, 2, [(2, (0, 2)), (3, (2, 4))])]),
}


# ---- the chunk plan (pure) ----------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("t2", [1, 2, 3, 4, 5])
def test_chunks_cover_every_element_once(t: int, t2: int) -> None:
    for numel in (1, 2, 5, 7, 12, 60, 61, 97, 1024):
        plan = ChunkPlan(t, t2, numel)
        n, c = plan.chunks, plan.chunk_numel
        assert n == math.lcm(t, t2) and c * n >= numel > (c - 1) * n  # c = ceil(numel / n)
        # every chunk leaves exactly one sender for exactly one receiver, the one that receives it
        sent = sorted((k, i, j) for i in range(t) for k, j in plan.sent_by(i))
        got = sorted((k, i, j) for j in range(t2) for k, i in plan.received_by(j))
        assert sent == got == [(k, k % t, k % t2) for k in range(n)]
        # each pair exchanges at most one chunk, each sender sends 1/t of the padded tensor
        assert len({(i, j) for _, i, j in sent}) == n
        assert all(plan.sent_numel(i) * t == n * c for i in range(t))
        # the spans partition [0, numel)
        covered = [e for k in range(n) for e in range(*plan.span(k))]
        assert covered == list(range(numel))


@pytest.mark.parametrize(("t", "t2", "numel"), [(2, 2, 10), (1, 3, 7), (3, 2, 31), (4, 6, 50), (2, 1, 9)])
def test_simulated_scatter_gather_rebuilds_the_tensor(t: int, t2: int, numel: int) -> None:
    """The runtime's layout (receiver j's slot m holds chunk j + m t'; gathered [t', n/t', c] read in
    [n/t', t', c] order) rebuilds the tensor, simulated without processes."""
    plan = ChunkPlan(t, t2, numel)
    n, c = plan.chunks, plan.chunk_numel
    x = torch.arange(numel, dtype=torch.float32) + 1
    padded = torch.zeros(n * c)
    padded[:numel] = x
    mine = torch.full((t2, plan.per_receiver, c), float("nan"))
    for i in range(t):
        for k, j in plan.sent_by(i):
            slot = [kk for kk, _ in plan.received_by(j)].index(k)
            mine[j, slot] = padded[k * c:(k + 1) * c]
    assert torch.equal(mine.transpose(0, 1).reshape(-1)[:numel], x)


def test_adjacent_stages_are_the_whole_neighbouring_tp_groups() -> None:
    plan = PLANS["1->2->1"]  # ranks: stage 0 [0], stage 1 [1, 2], stage 2 [3]
    assert [adjacent_stages(plan, r) for r in range(4)] == [
        ((), (1, 2)), ((0,), (3,)), ((0,), (3,)), ((1, 2), ())]


# ---- the step timer ------------------------------------------------------------------------------------------

def _ticks(monkeypatch: pytest.MonkeyPatch, values: list[float]) -> None:
    it = iter(values)
    monkeypatch.setattr(op_timer.time, "perf_counter", lambda: next(it))


def test_op_timer_on_cpu_reads_perf_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    _ticks(monkeypatch, [1.0, 1.25, 3.0])
    timer = OpTimer(torch.device("cpu"))
    a, b, c = timer.mark(), timer.mark(), timer.mark()
    assert timer.seconds(a, b) == 0.25  # CPU marks are final at once
    timer.finish()
    assert timer.seconds(a, c) == 2.0


class _FakeEvent:
    """Stands in for torch.cuda.Event: record() takes the next device time (ms) from `clock`."""

    clock: Iterator[float] = iter(())
    synced: list[_FakeEvent] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.ms: float | None = None

    def record(self) -> None:
        self.ms = next(self.clock)

    def synchronize(self) -> None:
        _FakeEvent.synced.append(self)

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.ms is not None and end.ms is not None
        return end.ms - self.ms


def test_op_timer_on_cuda_waits_once_for_the_last_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA, marks are events on the stream; nothing waits until finish(), which waits for the last one
    only (stream order makes the earlier ones complete); seconds come from elapsed_time (ms)."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(_FakeEvent, "clock", iter([10.0, 12.5, 20.0, 30.0]))
    monkeypatch.setattr(_FakeEvent, "synced", [])
    timer = OpTimer(torch.device("cuda"))
    a, b, c = timer.mark(), timer.mark(), timer.mark()
    with pytest.raises(RuntimeError):
        timer.seconds(a, b)
    assert _FakeEvent.synced == []
    timer.finish()
    assert len(_FakeEvent.synced) == 1 and _FakeEvent.synced[0].ms == 20.0
    assert timer.seconds(a, b) == pytest.approx(2.5e-3) and timer.seconds(a, c) == pytest.approx(10e-3)
    d = timer.mark()  # a new mark must be waited for again
    with pytest.raises(RuntimeError):
        timer.seconds(a, d)
    timer.finish()
    assert timer.seconds(c, d) == pytest.approx(10e-3)


def test_pipeline_times_add_up_marked_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve(): F / B spans to forward / backward (and ops, as seconds since `origin`), P spans to p2p."""
    _ticks(monkeypatch, [100.0, 100.5, 101.0, 101.25, 102.0, 103.0])
    timer = OpTimer(torch.device("cpu"))
    times = PipelineTimes(ops=[], origin=99.0)
    times.origin_mark, times.origin_offset = timer.mark(), 1.0  # the mark at 100 s is 1 s after the origin
    f0, f1, p0, p1, b0 = timer.mark(), timer.mark(), timer.mark(), timer.mark(), timer.mark()
    times.spans += [("F", 0, f0, f1), ("P", -1, p0, p1), ("B", 0, p1, b0)]
    timer.finish()
    times.resolve(timer)
    assert (times.forward, times.p2p, times.backward) == (0.5, 0.75, 1.0)
    assert times.ops == [("F", 0, 1.5, 2.0), ("B", 0, 3.0, 4.0)]
    assert times.spans == []


# ---- real runs ------------------------------------------------------------------------------------------------

def _worker(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, lean: bool,
            transfer_dtype: str) -> None:
    """Train STEPS steps of the plan with lean transfers on or off (and, when given, another transfer dtype);
    save losses, first-step full gradients, final full parameters, the bytes this rank sent in stage-boundary
    sends per step, and the first step's timings and ops."""
    sent = [0]
    real = dist.batch_isend_irecv

    def counting(ops: list[dist.P2POp]) -> list[dist.Work]:
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real(ops)

    with gloo_rank(rank, world, init_file):
        dist.batch_isend_irecv = counting  # type: ignore[assignment]  # this spawned process only
        try:
            plan = Plan.model_validate_json(plan_json)
            groups = build_groups(plan, rank)
            engine = RankEngine(plan, rank, groups, torch.device("cpu"), OPTIM, seed=SEED,
                                options=RuntimeOptions(lean_p2p=lean))
            if transfer_dtype:
                engine.runner.transfer_dtype = getattr(torch, transfer_dtype)
            batches = make_batches(plan)
            results, grads, per_step, first = [], {}, [], None
            for step in range(STEPS):
                before = sent[0]
                result = engine.train_step(batches[step][engine.pipeline_slice(plan.inputs.train.global_batch)],
                                           record_ops=step == 0)
                per_step.append(sent[0] - before)
                results.append((result.loss, result.grad_norm, result.lr))
                if step == 0:
                    grads = engine.gather_full_grads()
                    first = (result.timings, result.ops)
            torch.save({"results": results, "grads": grads, "params": engine.gather_full_params(), "sent": per_step,
                        "first": first}, Path(out_dir) / f"rank{rank}.pt")
        finally:
            dist.batch_isend_irecv = real  # type: ignore[assignment]


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """Five reusable worker processes (the largest plan has 5 ranks)."""
    with WorkerPool(5, _worker) as workers:
        yield workers


def _run(plan: Plan, tmp_path: Path, pool: WorkerPool, lean: bool, transfer_dtype: str = "") -> list[dict[str, Any]]:
    out_dir = tmp_path / f"run-{len(list(tmp_path.glob('run-*')))}"
    out_dir.mkdir()
    pool.run([(rank, plan.world_size, plan.to_json(), str(out_dir / "store"), str(out_dir), lean, transfer_dtype)
              for rank in range(plan.world_size)])
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(plan.world_size)]


def _expected_sent(plan: Plan, rank: int, lean: bool, element: int) -> int:
    """Bytes `rank` sends across stage boundaries in one step: per micro-batch one activation forward and one
    gradient backward; lean: its chunks (1/t of the padded tensor), else one full fp32 copy per destination."""
    pipe = plan.pipelines[0]
    numel = pipe.micro_batch_size * plan.inputs.train.seq_len * plan.inputs.model.hidden_size
    ranks = stage_ranks(plan)[0]
    s = next(s for s, members in enumerate(ranks) if rank in members)
    i = ranks[s].index(rank)
    total = 0
    for other in ([ranks[s + 1]] if s + 1 < len(ranks) else []) + ([ranks[s - 1]] if s > 0 else []):
        if lean:
            total += ChunkPlan(len(ranks[s]), len(other), numel).sent_numel(i) * element
        else:
            total += len([j for j in range(len(other)) if j % len(ranks[s]) == i]) * numel * 4
    return total * pipe.num_micro_batches


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_lean_equals_full_and_one_device(name: str, tmp_path: Path, pool: WorkerPool) -> None:
    plan = PLANS[name]
    lean, full = _run(plan, tmp_path, pool, lean=True), _run(plan, tmp_path, pool, lean=False)
    # fp32 on CPU: the same values cross the boundary, by another route (each chunk from one replica of the
    # replicated tensor, and the receivers' input gradients are identical after the TP all-reduce), so the
    # runs agree bit for bit.
    for rank, (a, b) in enumerate(zip(lean, full, strict=True)):
        assert a["results"] == b["results"], f"rank {rank}"
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), f"rank {rank}"
    # and equal one device, with test_parity's tolerances (its module docstring)
    ref = reference_train(plan.inputs.model, make_batches(plan), OPTIM, seed=SEED)
    seen: set[str] = set()
    for rank, out in enumerate(lean):
        losses = torch.tensor([r[0] for r in out["results"]], dtype=torch.float64)
        _assert_close(f"rank {rank} losses", losses, torch.tensor(ref.losses, dtype=torch.float64), RTOL, 0.0)
        for pname, grad in out["grads"].items():
            want = ref.grads[0][pname]
            _assert_close(f"rank {rank} grad {pname}", grad, want, RTOL,
                          grad_atol(want, plan.inputs.train.tokens_per_step))
            _assert_params(f"rank {rank} param {pname}", out["params"][pname], ref.params[pname])
            seen.add(pname)
    assert seen == set(ref.params)
    # bytes on the wire: 1/t of the tensor per sending rank (one tensor per boundary and direction in all)
    for rank in range(plan.world_size):
        assert lean[rank]["sent"] == [_expected_sent(plan, rank, True, 4)] * STEPS
        assert full[rank]["sent"] == [_expected_sent(plan, rank, False, 4)] * STEPS
    numel = plan.pipelines[0].micro_batch_size * plan.inputs.train.seq_len * plan.inputs.model.hidden_size
    boundaries = len(plan.pipelines[0].stages) - 1
    per_step = 2 * boundaries * plan.pipelines[0].num_micro_batches * numel * 4
    assert sum(out["sent"][0] for out in lean) == per_step  # these plans need no padding
    assert per_step == 2 * boundaries * plan.pipelines[0].num_micro_batches * numel * transfer_element_bytes(
        plan.inputs.train)  # what the cost model charges the lean transfers
    assert sum(out["sent"][0] for out in full) > per_step
    # timings come from the step's marks: every rank computed and spent time on transfers; ops were recorded
    for out in lean:
        timings, ops = out["first"]
        assert timings["forward"] > 0 and timings["backward"] > 0 and timings["p2p"] > 0
        m = plan.pipelines[0].num_micro_batches
        assert sorted((k, i) for k, i, _, _ in ops) == sorted([("B", i) for i in range(m)] + [("F", i) for i in range(m)])
        assert all(0 <= a <= b for _, _, a, b in ops)


@pytest.mark.slow
def test_half_precision_transfers_round_only_the_boundary(tmp_path: Path, pool: WorkerPool) -> None:
    """The compute-dtype path (bf16, as under CUDA autocast) forced on CPU: half the bytes cross, the stage
    still computes in fp32 on the cast-back tensor, and the losses stay within bf16 rounding of the reference:
    bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 2e-3) on each activation and gradient crossing;
    the mean loss over 64 tokens moves far less than that (1e-2 relative is a loose bound) but not zero."""
    plan = PLANS["1->2->1"]
    half = _run(plan, tmp_path, pool, lean=True, transfer_dtype="bfloat16")
    ref = reference_train(plan.inputs.model, make_batches(plan), OPTIM, seed=SEED)
    for rank, out in enumerate(half):
        assert out["sent"] == [_expected_sent(plan, rank, True, 2)] * STEPS
        losses = torch.tensor([r[0] for r in out["results"]], dtype=torch.float64)
        _assert_close(f"rank {rank} losses", losses, torch.tensor(ref.losses, dtype=torch.float64), 1e-2, 0.0)
        assert losses.tolist() != ref.losses  # the rounding really happened

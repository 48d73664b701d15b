"""An out-of-memory is one line (docs/reliability.md): the parser and classifier of runtime/device/oom.py as pure
functions, the checkpoint kept intact, the launcher's report, and real local launches of llama-tiny on three
emulated CPU ranks with the allocator's error injected at each phase (FLASHFLEX_OOM_INJECT)."""

from __future__ import annotations

import os
import re
import subprocess
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from flashflex_cli.cost.reestimate import reestimated, validate_plan
from flashflex_cli.errors import InputError
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.launch.failures import describe_failure, root_cause
from flashflex_cli.launch.local import RankExit
from flashflex_cli.plan.schema import Plan, load_plan, save_plan
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.device import oom
from flashflex_cli.runtime.parallel.shards import ShardSpec
from flashflex_cli.semantics.worker_protocol import is_oom_line
from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = str(GOLDEN / "cluster-2node.json")
GIB, MIB = 1024**3, 1024**2

# torch's allocator text as recorded on an H100 (data/gpu-h100-llama1b/run-mb8/FAILED.txt), and two layouts
# it takes elsewhere: another process named instead of "this process", and sizes in MiB with nothing free
H100 = ("CUDA out of memory. Tried to allocate 7.83 GiB. GPU 0 has a total capacity of 79.18 GiB of which 7.51 GiB "
        "is free. Including non-PyTorch memory, this process has 71.66 GiB memory in use. Of the allocated memory "
        "69.91 GiB is allocated by PyTorch, and 1.05 GiB is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
        "fragmentation.  See documentation for Memory Management  "
        "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
OTHER_PROCESS = ("CUDA out of memory. Tried to allocate 1.25 GiB. GPU 1 has a total capacity of 93.02 GiB of which "
                 "1.18 GiB is free. Process 2752205 has 91.82 GiB memory in use. Of the allocated memory 90.63 GiB "
                 "is allocated by PyTorch, and 120.54 MiB is reserved by PyTorch but unallocated.")
NOTHING_FREE = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 8.00 GiB of which "
                "0 bytes is free. Of the allocated memory 7.51 GiB is allocated by PyTorch, and 15.90 MiB is "
                "reserved by PyTorch but unallocated.")
HOST = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
        "allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)")


def _gib(x: float) -> int:
    return round(x * GIB)


def _near(parsed: int | None, expected: float, unit: int) -> bool:
    """Within the text's rounding: two decimals of its unit."""
    return parsed is not None and abs(parsed - expected) <= 0.005 * unit + 1


def test_parse_reads_the_allocator_figures_in_each_layout() -> None:
    f = oom.parse_oom_text(H100)
    assert _near(f.asked, 7.83 * GIB, GIB) and _near(f.in_use, 71.66 * GIB, GIB)
    assert _near(f.free, 7.51 * GIB, GIB) and _near(f.total, 79.18 * GIB, GIB)
    assert _near(f.allocated, 69.91 * GIB, GIB)
    g = oom.parse_oom_text(OTHER_PROCESS)  # no "this process": in use is PyTorch's allocated + reserved
    assert _near(g.in_use, 90.63 * GIB + 120.54 * MIB, GIB) and _near(g.free, 1.18 * GIB, GIB)
    h = oom.parse_oom_text(NOTHING_FREE)
    assert _near(h.asked, 20 * MIB, MIB) and h.free == 0 and _near(h.total, 8 * GIB, GIB)
    assert oom.parse_oom_text(HOST).asked == 64 * GIB
    assert oom.parse_oom_text(oom.NCCL_TEXT) == oom.MemoryFigures()  # NCCL's text carries no figures


@pytest.mark.parametrize("figures", [(_gib(7.83), _gib(79.18), _gib(7.51), _gib(71.66)),
                                     (512, 24 * GIB, 0, 23 * GIB), (3 * MIB + 17, 16 * GIB, 900 * 1024, 5 * GIB)])
def test_the_injected_text_reads_back_as_its_figures(figures: tuple[int, int, int, int]) -> None:
    asked, total, free, used = figures
    parsed = oom.parse_oom_text(oom.cuda_oom_message(asked, total, free, used))
    for got, want in ((parsed.asked, asked), (parsed.total, total), (parsed.free, free), (parsed.in_use, used)):
        assert oom.format_size(got) == oom.format_size(want)  # equal to the text's precision
    assert [oom.format_size(n) for n in (1024, 1025, MIB + 1, GIB + 1)] == \
        ["1024 bytes", "1.00 KiB", "1.00 MiB", "1.00 GiB"]  # torch's thresholds


def test_memory_is_low_below_one_gib_or_five_percent() -> None:
    assert oom.memory_is_low(GIB - 1, 8 * GIB) and not oom.memory_is_low(GIB, 8 * GIB)
    assert oom.memory_is_low(3 * GIB, 80 * GIB) and not oom.memory_is_low(5 * GIB, 80 * GIB)
    assert oom.memory_is_low(100 * MIB, None) and not oom.memory_is_low(None, 80 * GIB)


def test_classify_names_the_out_of_memory_kinds_and_nothing_else() -> None:
    alloc = torch.OutOfMemoryError(H100)
    assert oom.classify(alloc) == ("allocator", alloc)
    nccl = dist.DistBackendError(oom.NCCL_TEXT)
    assert oom.classify(nccl, free=200 * MIB, total=80 * GIB) == ("nccl", nccl)
    assert oom.classify(nccl, free=40 * GIB, total=80 * GIB) is None  # plenty free: some other CUDA failure
    assert oom.classify(nccl) is None  # free memory unknown: not called memory
    said = RuntimeError("NCCL WARN Cuda failure 2 'out of memory'")
    assert oom.classify(said, free=40 * GIB, total=80 * GIB) == ("nccl", said)  # its text says so
    cuda = RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")
    assert oom.classify(cuda) == ("cuda", cuda)
    host = RuntimeError(HOST)
    assert oom.classify(host) == ("host", host) and oom.classify(MemoryError())[0] == "host"
    try:  # raised while handling it: the out-of-memory underneath is found
        try:
            raise alloc
        except RuntimeError:
            raise RuntimeError("loss became NaN") from None
    except RuntimeError as wrapped:
        assert oom.classify(wrapped) == ("allocator", alloc)
    for other in (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"), ValueError("bad"),
                  RuntimeError("checkpoint save in /ck stopped: peer rank 1 ran out of memory")):
        assert oom.classify(other) is None
    # DCP gathers every rank's error: a peer's out-of-memory in it is not this rank's
    assert oom.classify(dcp.api.CheckpointException("save", {1: (alloc, traceback.StackSummary())})) is None


def _place(**change: object) -> oom.StagePlace:
    base = dict(rank=5, device="node1/2", pipeline=1, stage=2, layers=(10, 16), tp=2,
                micro_batch_size=8, recompute=False, predicted_bytes=64.0e9, capacity_bytes=80.8e9)
    return oom.StagePlace(**{**base, **change})  # type: ignore[arg-type]


def test_the_line_names_place_phase_bytes_prediction_and_advice() -> None:
    line = oom.oom_line("allocator", _place(), "backward", 2, oom.parse_oom_text(H100))
    assert line == ("out of memory on rank 5 (node node1, device node1/2; pipeline 1, stage 2, layers 10-15, "
                    "tp 2, micro-batch 8) during the backward pass of step 3: 7.83 GiB asked, 71.66 GiB in use, "
                    "7.51 GiB free of 79.18 GiB; the plan predicted 59.60 GiB of 75.25 GiB for this stage; to fit, "
                    "plan again with --recompute, with a smaller --max-micro-batch or --micro-batch (this pipeline "
                    "runs micro-batches of 8), or with more devices (or devices with more memory)")
    assert "\n" not in line and is_oom_line(line)
    bare = oom.oom_line("nccl", _place(recompute=True, micro_batch_size=1, predicted_bytes=None), "nccl", 0,
                        oom.MemoryFigures(free=300 * MIB, total=80 * GIB, allocated=70 * GIB))
    assert bare == ("out of memory inside NCCL on rank 5 (node node1, device node1/2; pipeline 1, stage 2, "
                    "layers 10-15, tp 2, micro-batch 1) during NCCL set-up: the allocation failed inside NCCL, "
                    "70.00 GiB allocated by PyTorch, 300.00 MiB free of 80.00 GiB; the plan carries no memory "
                    "prediction for this stage; to fit, plan again with more devices (or devices with more memory)")
    host = oom.oom_line("host", _place(), "forward", 0, oom.parse_oom_text(HOST))
    assert host.startswith("out of memory in host memory on rank 5 ") and ": 64.00 GiB asked; the plan" in host
    after = oom.oom_line("allocator", _place(), "checkpoint", 9, oom.MemoryFigures())
    assert "during the checkpoint save after step 10: the bytes in use are unknown;" in after


def test_injection_spec_is_parsed_strictly_and_raises_what_torch_raises() -> None:
    spec = oom.OomInjection.parse("rank=2,phase=backward,step=3,asked=1024")
    assert (spec.rank, spec.phase, spec.step, spec.asked) == (2, "backward", 3, 1024)
    assert spec.matches(2, "backward", 3) and not spec.matches(2, "backward", 2) and not spec.matches(1, "backward", 3)
    assert oom.OomInjection.parse("rank=0,phase=setup").matches(0, "setup", 7)  # no step: any
    for bad in ("rank=1", "phase=forward", "rank=x,phase=forward", "rank=1,phase=loss", "rank=1,phase=setup,when=3",
                "rank=-1,phase=setup", "rank=1,phase=setup,step"):
        with pytest.raises(InputError, match=oom.INJECT_ENV):
            oom.OomInjection.parse(bad)
    error = oom.OomInjection.parse("rank=0,phase=forward").error()
    assert type(error) is torch.OutOfMemoryError and oom.parse_oom_text(str(error)) == oom.parse_oom_text(H100)
    nccl = oom.OomInjection.parse("rank=0,phase=nccl").error()
    assert type(nccl) is dist.DistBackendError and "unhandled cuda error" in str(nccl)
    assert oom.injection_from_env({}) is None and oom.injection_from_env({oom.INJECT_ENV: " "}) is None


def test_tracker_fires_once_at_the_phase_and_step_asked() -> None:
    tracker = oom.PhaseTracker(1, oom.OomInjection.parse("rank=1,phase=optimizer,step=1"))
    for step in range(2):
        tracker.begin_step(step)
        tracker.enter("backward")
        if step == 0:
            tracker.enter("optimizer")
    with pytest.raises(torch.OutOfMemoryError):
        tracker.enter("optimizer")
    assert (tracker.phase, tracker.step) == ("optimizer", 1)
    tracker.enter("optimizer")  # fired once only


@pytest.fixture(scope="module")
def predicted_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """plan-3rank.json with the cost model's prediction: rank 0 and 1 are pipeline 0's two stages (layers 0-1
    and 2-3, micro-batch 1), rank 2 is pipeline 1's one stage (layers 0-3, micro-batch 2)."""
    plan = load_plan(GOLDEN / "plan-3rank.json")
    checked = validate_plan(plan, load_cluster(CLUSTER))
    assert checked.estimate is not None
    path = tmp_path_factory.mktemp("plan") / "plan-3rank-predicted.json"
    save_plan(path, reestimated(plan, checked.estimate))
    return path


def test_report_reads_the_free_memory_for_nccl_and_is_none_for_other_errors(predicted_plan: Path) -> None:
    plan = load_plan(predicted_plan)
    place = oom.stage_place(plan, 2)
    stage = next(s for s in plan.predicted["stages"] if (s["pipeline"], s["stage"]) == (1, 0))  # type: ignore[index]
    assert (place.pipeline, place.stage, place.layers, place.micro_batch_size) == (1, 0, (0, 4), 2)
    assert (place.predicted_bytes, place.capacity_bytes) == (stage["memory_bytes"], stage["memory_capacity_bytes"])
    tracker = oom.PhaseTracker()
    assert oom.report(torch.OutOfMemoryError(H100), tracker) is None  # before the worker knows its place
    low = oom.OomInjection.parse(f"rank=2,phase=nccl,free={200 * MIB},total={80 * GIB}")
    tracker.attach(place, torch.device("cpu"), low)
    tracker.enter("setup")
    line = oom.report(dist.DistBackendError(oom.NCCL_TEXT), tracker)
    assert line is not None and line.startswith("out of memory inside NCCL on rank 2 (node node1, device node1/0;")
    assert "during set-up (building the engine): the allocation failed inside NCCL, " in line
    assert re.search(r"NCCL, [0-9.]+ MiB in use, 200.00 MiB free of 80.00 GiB;", line), line  # resident bytes
    tracker.attach(place, torch.device("cpu"), oom.OomInjection.parse(f"rank=2,phase=nccl,free={40 * GIB}"))
    assert oom.report(dist.DistBackendError(oom.NCCL_TEXT), tracker) is None
    assert oom.report(RuntimeError("Connection closed by peer"), tracker) is None


def test_the_launcher_reports_the_out_of_memory_line_over_its_peers(predicted_plan: Path) -> None:
    plan = load_plan(predicted_plan)
    line = oom.oom_line("allocator", oom.stage_place(plan, 1), "forward", 0, oom.parse_oom_text(H100))
    failures = {0: RankExit(0, 3, 5.0), 1: RankExit(1, 1, 6.0, reason=line),
                2: RankExit(2, -9, 4.0, stopped=False), 3: RankExit(3, 1, 3.0, reason="no heartbeat", silent=True)}
    assert root_cause(failures)[0] == 1  # before a rank killed by a signal or gone silent meanwhile
    assert str(describe_failure(plan, None, failures)) == f"{line}; 3 other rank(s) stopped after it; the job was stopped"


def _state(value: float) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    return {"w": torch.full((4, 6), value)}, {"w": ShardSpec("w", (4, 6), None, 0, 1, True)}


def test_out_of_memory_while_saving_keeps_the_previous_checkpoint(tmp_path: Path, world_of_one: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt.save(tmp_path, 1, *_state(1.0), {})
    ckpt.save(tmp_path, 2, *_state(2.0), {})

    def out_of_memory(*_args: object, **_kwargs: object) -> None:  # NCCL gathers objects through device memory
        raise torch.OutOfMemoryError(H100)

    for step in (3, 2):  # a new step, and the same step again (a run restarted without --resume)
        with monkeypatch.context() as patch, pytest.raises(torch.OutOfMemoryError):
            patch.setattr(ckpt.dist, "all_gather_object", out_of_memory)  # runs after DCP wrote the shards
            with ckpt.one_line_save_errors(tmp_path):
                ckpt.save(tmp_path, step, *_state(-1.0), {})
        assert (tmp_path / f"step-{step:06d}.tmp").is_dir()  # half written, under a name no load picks
        assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000002"
        assert torch.equal(ckpt.load_full(tmp_path / "step-000002", ["w"])["w"], torch.full((4, 6), 2.0))
    ckpt.save(tmp_path, 2, *_state(4.0), {})  # the same step saved again replaces it once complete
    assert torch.equal(ckpt.load_full(ckpt.latest_checkpoint(tmp_path), ["w"])["w"], torch.full((4, 6), 4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001", "step-000002"]


def test_a_save_stopped_by_a_ranks_out_of_memory_names_it_on_that_rank_only(tmp_path: Path) -> None:
    error = torch.OutOfMemoryError(H100)
    gathered = dcp.api.CheckpointException("save", {1: (error, traceback.StackSummary())})
    assert ckpt.save_error(tmp_path, gathered, rank=1) is error
    peer = ckpt.save_error(tmp_path, gathered, rank=0)
    assert isinstance(peer, RuntimeError) and str(peer) == f"checkpoint save in {tmp_path} stopped: peer rank 1 " \
        "ran out of memory"
    assert oom.classify(peer) is None


# phase -> (injection, the line's phase text); ranks vary so each stage kind is named
CASES = {
    "setup": ("rank=1,phase=setup", "during set-up (building the engine): "),
    "nccl": (f"rank=0,phase=nccl,free={256 * MIB},total={_gib(79.18)}", "during NCCL set-up: "),
    "forward": ("rank=2,phase=forward,step=1", "during the forward pass of step 2: "),
    "backward": ("rank=0,phase=backward,step=0", "during the backward pass of step 1: "),
    "optimizer": ("rank=1,phase=optimizer,step=1", "during the optimizer step of step 2: "),
    "checkpoint": ("rank=2,phase=checkpoint,step=1", "during the checkpoint save after step 2: "),
}


def _expected_place(plan: Plan, rank: int) -> tuple[str, str]:
    """The parts of the line that name the rank's place and its stage's prediction, from the plan file."""
    me = plan.ranks()[rank]
    pipe = plan.pipelines[me.pipeline]
    a, b = pipe.stages[me.stage].layers
    stage = next(s for s in plan.predicted["stages"]  # type: ignore[index]
                 if (s["pipeline"], s["stage"]) == (me.pipeline, me.stage))
    return (f"on rank {rank} (node {me.device.split('/')[0]}, device {me.device}; pipeline {me.pipeline}, stage "
            f"{me.stage}, layers {a}-{b - 1}, tp 1, micro-batch {pipe.micro_batch_size}) ",
            f"; the plan predicted {oom.format_size(stage['memory_bytes'])} of "
            f"{oom.format_size(stage['memory_capacity_bytes'])} for this stage; to fit, plan again with --recompute")


@pytest.mark.slow
@pytest.mark.parametrize("phase", list(CASES))
def test_out_of_memory_at_each_phase_is_one_line_and_exit_1(phase: str, predicted_plan: Path, tmp_path: Path,
                                                            world_of_one: None) -> None:
    inject, when = CASES[phase]
    ck = tmp_path / "ck"
    result = subprocess.run([FLASHFLEX, "launch", str(predicted_plan), "--cluster", CLUSTER, "--out",
                             str(tmp_path / "run"), "--steps", "3", "--timeout", "30", "--checkpoint-dir", str(ck),
                             "--checkpoint-every", "1"], capture_output=True, text=True, timeout=240,
                            env={**os.environ, oom.INJECT_ENV: inject})
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    rank = int(inject.split(",")[0].removeprefix("rank="))
    place, prediction = _expected_place(load_plan(predicted_plan), rank)
    mine = [line.removeprefix("flashflex worker: ") for line in result.stderr.splitlines()
            if line.startswith("flashflex worker")]
    line = mine[0]  # the rank that ran out of memory speaks first; its peers follow
    inside = " inside NCCL" if phase == "nccl" else ""
    assert line.startswith(f"out of memory{inside} {place}{when}"), line
    assert prediction in line, line
    if phase == "nccl":
        assert re.search(r"the allocation failed inside NCCL, [0-9.]+ MiB in use, 256.00 MiB free of 79.18 GiB;",
                         line), line
    else:
        assert "7.83 GiB asked, 71.66 GiB in use, 7.51 GiB free of 79.18 GiB;" in line, line
    assert ("--max-micro-batch" in line) == (rank == 2)  # only pipeline 1 runs micro-batches of 2
    assert all(not other.startswith("out of memory") for other in mine[1:])  # peers lost a peer, no more
    last = result.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: {re.escape(line)}(; \d other rank\(s\) stopped after it)?; the job was stopped",
                        last), last
    if phase == "checkpoint":  # the save after step 1 is intact and loads; the failed one is not complete
        found = ckpt.latest_checkpoint(ck)
        assert found == ck / "step-000001" and not (ck / "step-000002" / ckpt.MANIFEST).exists()
        assert int(ckpt.load_full(found, ["step"])["step"]) == 1

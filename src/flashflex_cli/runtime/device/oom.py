"""An out-of-memory on a rank, told in one line: where it happened (rank, node, device, pipeline, stage, layers,
phase, step), by how much (bytes asked, in use, free of total), what the plan predicted for that stage, and what
to change (`--recompute`, a smaller micro-batch at plan time, more devices).

Written by hand because torch gives none of it as data: its caching allocator raises `torch.OutOfMemoryError`
with the figures only in the text (format of c10/cuda/CUDACachingAllocator.cpp, parsed by `parse_oom_text`);
an allocation that fails inside NCCL arrives as a `DistBackendError` "NCCL error in: ..., unhandled cuda error"
with no figures at all, so `classify` calls it an out-of-memory when the text says so or the device's free
memory (`torch.cuda.mem_get_info`) is low (`memory_is_low`); and nothing in torch knows the plan's stages.

The phase comes from a `PhaseTracker` the worker, RankEngine and PipelineRunner update as they go (`enter`):
"nccl" (process group and communicators), "setup" (building the engine, resuming), then per step "forward",
"backward" (with the data-parallel gradient reduction), "optimizer" (to the end of the step) and "checkpoint".

Tests raise such errors on purpose with FLASHFLEX_OOM_INJECT (runtime/device/oom_injection.py).

The launcher recognises these lines by their first words (semantics/worker_protocol.py's `is_oom_line`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from ...semantics.worker_protocol import OOM_LINE_PREFIX

if TYPE_CHECKING:
    from ...plan.schema import Plan

PHASES = ("setup", "nccl", "forward", "backward", "optimizer", "checkpoint")
STEP_PHASES = ("forward", "backward", "optimizer", "checkpoint")
PHASE_TEXT = {"setup": "set-up (building the engine)", "nccl": "NCCL set-up", "forward": "the forward pass",
              "backward": "the backward pass", "optimizer": "the optimizer step", "checkpoint": "the checkpoint save"}

GIB = 1024**3
LOW_FREE_BYTES = GIB  # below this many free bytes, or LOW_FREE_FRACTION of the device, memory is low
LOW_FREE_FRACTION = 0.05

_UNITS = {"bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": GIB, "TiB": 1024**4}
_SIZE = r"([0-9]+(?:\.[0-9]+)?) (bytes|KiB|MiB|GiB|TiB)"
_ASKED = re.compile(r"Tried to allocate " + _SIZE)
_CAPACITY = re.compile(r"total capacity of " + _SIZE + r" of which " + _SIZE + r" is free")
_PROCESS = re.compile(r"this process has " + _SIZE + r" memory in use")
_ALLOCATED = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch")
_RESERVED = re.compile(r"and " + _SIZE + r" is reserved by PyTorch but unallocated")
_HOST_ASKED = re.compile(r"you tried to allocate ([0-9]+) bytes")

def format_size(nbytes: float) -> str:
    """Bytes as torch's allocator writes them: "N bytes" up to 1 KiB, else KiB, MiB or GiB with 2 decimals."""
    if nbytes <= 1024:
        return f"{int(nbytes)} bytes"
    for unit, size in (("KiB", 1024), ("MiB", 1024**2)):
        if nbytes <= size * 1024:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes / GIB:.2f} GiB"


@dataclass(frozen=True)
class MemoryFigures:
    """What is known of a failed allocation (bytes; None: unknown): the request, this process's memory in use
    (PyTorch's and the rest: CUDA context, NCCL), the device's free memory and capacity, PyTorch's allocated
    bytes."""

    asked: int | None = None
    in_use: int | None = None
    free: int | None = None
    total: int | None = None
    allocated: int | None = None


def _bytes(match: re.Match[str] | None, group: int = 1) -> int | None:
    if match is None:
        return None
    return round(float(match.group(group)) * _UNITS[match.group(group + 1)])


def parse_oom_text(text: str) -> MemoryFigures:
    """The figures in torch's out-of-memory text (CUDA's caching allocator, or the CPU allocator's "you tried
    to allocate N bytes"); fields the text lacks are None. In use: "this process has X memory in use", else
    PyTorch's allocated plus reserved bytes (the text names other processes instead when there are some)."""
    capacity = _CAPACITY.search(text)
    allocated = _bytes(_ALLOCATED.search(text))
    reserved = _bytes(_RESERVED.search(text))
    in_use = _bytes(_PROCESS.search(text))
    if in_use is None and allocated is not None and reserved is not None:
        in_use = allocated + reserved
    asked = _bytes(_ASKED.search(text))
    host = _HOST_ASKED.search(text)
    if asked is None and host is not None:
        asked = int(host.group(1))
    return MemoryFigures(asked=asked, in_use=in_use, free=_bytes(capacity, 3), total=_bytes(capacity, 1),
                         allocated=allocated)


def memory_is_low(free: int | None, total: int | None) -> bool:
    """True when `free` bytes of a `total`-byte device is below LOW_FREE_BYTES or LOW_FREE_FRACTION of it
    (NCCL's buffers take tens to hundreds of MiB per communicator); False when unknown."""
    if free is None:
        return False
    return free < LOW_FREE_BYTES or (total is not None and free < LOW_FREE_FRACTION * total)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or while handling, without DCP's CheckpointException (its
    text holds every rank's error; checkpoint.save_error picks this rank's own out of it)."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        item = stack.pop()
        if id(item) in seen or type(item).__name__ == "CheckpointException":
            continue
        seen.add(id(item))
        yield item
        stack.extend(e for e in (item.__cause__, item.__context__) if e is not None)


def classify(exc: BaseException, free: int | None = None, total: int | None = None) -> tuple[str, BaseException] | None:
    """Whether `exc` (or an exception it came from) is an out-of-memory, and which: ("allocator", e) torch's
    caching allocator, ("cuda", e) a CUDA call outside it ("CUDA error: out of memory"), ("nccl", e) an
    allocation inside NCCL ("NCCL error ... unhandled cuda error" while the device's `free` of `total` bytes is
    low, or NCCL's text saying out of memory), ("host", e) host memory (the CPU allocator, MemoryError); None
    otherwise. `e` is the exception holding the figures. Pure."""
    for item in _chain(exc):
        text = str(item)
        if "NCCL" in text and ("unhandled cuda error" in text or "out of memory" in text.lower()):
            if "out of memory" in text.lower() or memory_is_low(free, total):
                return "nccl", item
            continue
        if type(item).__name__ == "OutOfMemoryError" or "CUDA out of memory" in text:
            return "allocator", item
        if "CUDA error: out of memory" in text:
            return "cuda", item
        if isinstance(item, MemoryError) or "DefaultCPUAllocator: can't allocate memory" in text:
            return "host", item
    return None


@dataclass(frozen=True)
class StagePlace:
    """Where a rank sits in its plan, and the plan's memory prediction for its stage (bytes; None: none)."""

    rank: int
    device: str
    pipeline: int
    stage: int
    layers: tuple[int, int]
    tp: int
    micro_batch_size: int
    recompute: bool
    predicted_bytes: float | None = None
    capacity_bytes: float | None = None

    @property
    def node(self) -> str:
        """The plan node of the device ("node0" of "node0/1")."""
        return self.device.rpartition("/")[0]


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def stage_place(plan: Plan, rank: int) -> StagePlace:
    """The StagePlace of plan rank `rank`; the prediction is the entry of `plan.predicted.stages` for its
    pipeline and stage, where the plan carries one."""
    me = plan.ranks()[rank]
    pipe = plan.pipelines[me.pipeline]
    stage = pipe.stages[me.stage]
    predicted = capacity = None
    for entry in (plan.predicted.stages or []) if plan.predicted else []:
        if (entry.pipeline, entry.stage) == (me.pipeline, me.stage):
            predicted, capacity = _finite(entry.memory_bytes), _finite(entry.memory_capacity_bytes)
    return StagePlace(rank=rank, device=me.device, pipeline=me.pipeline, stage=me.stage,
                      layers=(stage.layers[0], stage.layers[1]), tp=stage.tp,
                      micro_batch_size=pipe.micro_batch_size, recompute=plan.inputs.train.recompute,
                      predicted_bytes=predicted, capacity_bytes=capacity)


def advice(place: StagePlace) -> str:
    """What could make the stage fit, in the planner's own options."""
    ways = [] if place.recompute else ["--recompute"]
    if place.micro_batch_size > 1:
        ways.append(f"a smaller --max-micro-batch or --micro-batch (this pipeline runs micro-batches of "
                    f"{place.micro_batch_size})")
    ways.append("more devices (or devices with more memory)")
    ways = [f"with {way}" for way in ways]
    return "to fit, plan again " + (", ".join(ways[:-1]) + ", or " + ways[-1] if len(ways) > 1 else ways[0])


def _figures_text(kind: str, figures: MemoryFigures) -> str:
    parts = []
    if kind == "nccl":
        parts.append("the allocation failed inside NCCL")
    if figures.asked is not None:
        parts.append(f"{format_size(figures.asked)} asked")
    if figures.in_use is not None:
        parts.append(f"{format_size(figures.in_use)} in use")
    elif figures.allocated is not None:
        parts.append(f"{format_size(figures.allocated)} allocated by PyTorch")
    if figures.free is not None:
        of = f" of {format_size(figures.total)}" if figures.total is not None else ""
        parts.append(f"{format_size(figures.free)} free{of}")
    if len(parts) == (1 if kind == "nccl" else 0):
        parts.append("the bytes in use are unknown")
    return ", ".join(parts)


def oom_line(kind: str, place: StagePlace, phase: str, step: int, figures: MemoryFigures) -> str:
    """The one line (see the module docstring). `step` counts from 0; the line counts from 1, as the progress
    lines do. Pure."""
    inside = {"nccl": " inside NCCL", "host": " in host memory"}.get(kind, "")
    when = f"during {PHASE_TEXT.get(phase, phase)}"
    if phase in STEP_PHASES:
        when += f" {'after' if phase == 'checkpoint' else 'of'} step {step + 1}"
    a, b = place.layers
    where = (f"rank {place.rank} (node {place.node}, device {place.device}; pipeline {place.pipeline}, stage "
             f"{place.stage}, layers {a}-{b - 1}, tp {place.tp}, micro-batch {place.micro_batch_size})")
    if place.predicted_bytes is not None:
        capacity = f" of {format_size(place.capacity_bytes)}" if place.capacity_bytes is not None else ""
        predicted = f"the plan predicted {format_size(place.predicted_bytes)}{capacity} for this stage"
    else:
        predicted = "the plan carries no memory prediction for this stage"
    return (f"{OOM_LINE_PREFIX}{inside} on {where} {when}: {_figures_text(kind, figures)}; {predicted}; "
            f"{advice(place)}")


class InjectedFailure(Protocol):
    """A failure a test asks for (runtime/device/oom_injection.py's OomInjection): where it fires, what it raises,
    and the device figures (bytes; None: not given) it stands in for."""

    free: int | None
    total: int | None

    def matches(self, rank: int, phase: str, step: int) -> bool: ...

    def error(self) -> BaseException: ...


class PhaseTracker:
    """Which phase this rank is in (see PHASES) and its step, updated by the code that runs them (`enter`,
    `begin_step`); a failure is told in the phase entered last. Armed with an injected failure
    (oom_injection.py), `enter` raises it
    once where it matches. `place` and `device` are set by the worker once the plan is read."""

    def __init__(self, rank: int = -1, injection: InjectedFailure | None = None) -> None:
        self.rank, self.injection = rank, injection
        self.phase, self.step = "setup", 0
        self.place: StagePlace | None = None
        self.device: Any = None
        self._fired = False

    def attach(self, place: StagePlace, device: Any, injection: InjectedFailure | None = None) -> None:
        """Name the rank's place in the plan and its torch.device; arm `injection`."""
        self.rank, self.place, self.device, self.injection = place.rank, place, device, injection

    def enter(self, phase: str) -> None:
        """Note that `phase` begins (raises an armed injection that matches)."""
        self.phase = phase
        if self.injection is not None and not self._fired and self.injection.matches(self.rank, phase, self.step):
            self._fired = True
            raise self.injection.error()

    def begin_step(self, step: int) -> None:
        """Note that step `step` (from 0) begins; its first phase is the forward pass (reading its batch)."""
        self.step = step
        self.enter("forward")


def device_memory(device: Any, injection: InjectedFailure | None = None) -> MemoryFigures:
    """What `device` (a torch.device) reports now: on a GPU its free and total bytes (torch.cuda.mem_get_info)
    and PyTorch's allocated bytes; on an emulated CPU device this process's resident bytes as in use. An
    injection's `free` / `total` stand in where given."""
    figures = MemoryFigures()
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        try:
            free, total = torch.cuda.mem_get_info(device)
            figures = MemoryFigures(free=int(free), total=int(total),
                                    allocated=int(torch.cuda.memory_allocated(device)))
        except RuntimeError:
            pass  # the CUDA context itself is broken: report without figures
    elif device is not None:
        from .memory import resident_bytes

        figures = MemoryFigures(in_use=resident_bytes() or None)
    if injection is not None:
        figures = replace(figures, free=injection.free if injection.free is not None else figures.free,
                          total=injection.total if injection.total is not None else figures.total)
    return figures


def report(exc: BaseException, tracker: PhaseTracker) -> str | None:
    """The one line for `exc` when it is an out-of-memory on this rank (None otherwise, or before the worker
    knew its place in the plan). Figures from the error's text, completed from the device's memory query."""
    if tracker.place is None:
        return None
    queried = device_memory(tracker.device, tracker.injection)
    found = classify(exc, queried.free, queried.total)
    if found is None:
        return None
    kind, error = found
    parsed = parse_oom_text(str(error))
    if kind == "host" and getattr(tracker.device, "type", None) == "cuda":
        queried = MemoryFigures()  # the GPU's figures say nothing of the host's memory
    figures = replace(parsed, **{name: getattr(queried, name) for name in ("in_use", "free", "total", "allocated")
                                 if getattr(parsed, name) is None})
    return oom_line(kind, tracker.place, tracker.phase, tracker.step, figures)

"""Out-of-memory errors raised on purpose, for tests: FLASHFLEX_OOM_INJECT="rank=R,phase=P[,step=K][,asked=B]
[,used=B][,free=B][,total=B]" makes plan rank R raise, on entering phase P (runtime/device/oom.py's PHASES) of
step K (counted from 0, as FLASHFLEX_FAULT_INJECT; any step when absent), what the real allocator raises:
torch.OutOfMemoryError with CUDA's text for its figures (bytes; defaults: those of a recorded H100 run), or for
phase "nccl" the DistBackendError NCCL raises. `free` and `total` also stand in for the device's free-memory
query (so an emulated CPU device can report low memory). The worker arms it (`injection_from_env`) in the
rank's PhaseTracker, which raises it where it matches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...semantics.worker_protocol import parse_injection
from .oom import GIB, PHASES, format_size

INJECT_ENV = "FLASHFLEX_OOM_INJECT"
# the allocator's figures (bytes) in a recorded H100 run that did not fit (data/gpu-h100-llama1b, run-mb8)
DEFAULT_FIGURES = {"asked": round(7.83 * GIB), "used": round(71.66 * GIB), "free": round(7.51 * GIB),
                   "total": round(79.18 * GIB)}
# of the bytes in use there, the shares allocated by PyTorch and reserved by it but unallocated
ALLOCATED_SHARE, RESERVED_SHARE = 69.91 / 71.66, 1.05 / 71.66
NCCL_TEXT = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, unhandled cuda error (run "
             "with NCCL_DEBUG=INFO for details), NCCL version 2.28.9")


def cuda_oom_message(asked: int, total: int, free: int, used: int, gpu: int = 0) -> str:
    """The text of torch's CUDA out-of-memory error for these figures (bytes): `used` by this process, split
    into PyTorch's allocated and reserved bytes and the rest (CUDA context, NCCL) as in the recorded run."""
    allocated, reserved = round(used * ALLOCATED_SHARE), round(used * RESERVED_SHARE)
    return (f"CUDA out of memory. Tried to allocate {format_size(asked)}. GPU {gpu} has a total capacity of "
            f"{format_size(total)} of which {format_size(free)} is free. Including non-PyTorch memory, this "
            f"process has {format_size(used)} memory in use. Of the allocated memory {format_size(allocated)} is "
            f"allocated by PyTorch, and {format_size(reserved)} is reserved by PyTorch but unallocated. "
            "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")


@dataclass(frozen=True)
class OomInjection:
    """A test's request (FLASHFLEX_OOM_INJECT) to raise an out-of-memory on plan rank `rank` on entering
    `phase` of `step` (None: any step); figures in bytes."""

    rank: int
    phase: str
    step: int | None = None
    asked: int = DEFAULT_FIGURES["asked"]
    used: int = DEFAULT_FIGURES["used"]
    free: int | None = None
    total: int | None = None

    @classmethod
    def parse(cls, text: str) -> OomInjection:
        """Parse "rank=R,phase=P[,step=K][,asked=B][,used=B][,free=B][,total=B]"; InputError naming the field."""
        fields = parse_injection(INJECT_ENV, text, ("rank", "phase", "step", "asked", "used", "free", "total"),
                                 ("rank", "phase"), {"phase": PHASES})
        return cls(**fields)

    def matches(self, rank: int, phase: str, step: int) -> bool:
        """Whether this injection fires for `rank` entering `phase` of `step`."""
        return rank == self.rank and phase == self.phase and self.step in (None, step)

    def error(self) -> BaseException:
        """What the real allocator (or NCCL, for phase "nccl") raises."""
        import torch
        import torch.distributed as dist

        if self.phase == "nccl":
            return dist.DistBackendError(NCCL_TEXT)
        total = self.total if self.total is not None else DEFAULT_FIGURES["total"]
        free = self.free if self.free is not None else DEFAULT_FIGURES["free"]
        return torch.OutOfMemoryError(cuda_oom_message(self.asked, total, free, self.used))


def injection_from_env(env: Mapping[str, str]) -> OomInjection | None:
    """The injection FLASHFLEX_OOM_INJECT asks for (None when unset or empty)."""
    text = env.get(INJECT_ENV, "").strip()
    return OomInjection.parse(text) if text else None

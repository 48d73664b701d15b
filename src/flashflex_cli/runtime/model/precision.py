"""The runtime's precision: fp32 parameters, gradients and optimizer state; matmuls under torch.autocast in the
plan's 16-bit dtype on every device (CUDA and CPU alike), so a CPU-emulated run computes what a GPU run does.
semantics/runtime_paths.compute_dtype is the same rule for the cost model."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from ...semantics.runtime_paths import compute_dtype

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(plan_dtype: str) -> torch.dtype | None:
    """The autocast dtype of a plan trained in `plan_dtype` (None: plain fp32 compute)."""
    return _TORCH_DTYPES.get(compute_dtype(plan_dtype))


def autocast(device: torch.device, plan_dtype: str) -> AbstractContextManager[object]:
    """The autocast context of the runtime's compute on `device` for `plan_dtype` (a no-op for fp32/tf32)."""
    dtype = autocast_dtype(plan_dtype)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)

"""The runtime's precision: fp32 parameters, gradients and optimizer state; matmuls under torch.autocast in the
plan's 16-bit dtype on every device (CUDA and CPU alike), so a CPU-emulated run computes what a GPU run does;
fp32 matmuls on TF32 tensor cores for "tf32" plans on CUDA.
semantics/runtime_paths.compute_dtype is the same rule for the cost model."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from ...semantics.runtime_paths import compute_dtype

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(plan_dtype: str) -> torch.dtype | None:
    """The autocast dtype of a plan trained in `plan_dtype` (None: plain fp32 compute)."""
    return _TORCH_DTYPES.get(compute_dtype(plan_dtype))


def use_tf32_matmuls(device: torch.device, plan_dtype: str) -> None:
    """On CUDA, fp32 matmuls and convolutions on TF32 tensor cores exactly when the plan says "tf32" (its tensors
    stay fp32); CPU has no such mode."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = plan_dtype == "tf32"
        torch.backends.cudnn.allow_tf32 = plan_dtype == "tf32"


def autocast(device: torch.device, plan_dtype: str) -> AbstractContextManager[object]:
    """The autocast context of the runtime's compute on `device` for `plan_dtype` (a no-op for fp32/tf32)."""
    dtype = autocast_dtype(plan_dtype)
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)

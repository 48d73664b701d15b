"""Waiting for a device: CUDA kernels and NCCL calls only enqueue work on a stream, so a host timer around them
needs the device to finish first. The one home of that wait, for the hardware probes, the runtime and the layer
profiler."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Block until every kernel queued on `device` has run (nothing to wait for on CPU: ops run at once)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)

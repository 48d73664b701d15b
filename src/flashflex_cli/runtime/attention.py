"""Attention backend: flash-attn's `flash_attn_func` where installed and supported (CUDA SM80 or newer,
bf16/fp16), else `torch.nn.functional.scaled_dot_product_attention`. Chosen per rank and logged on the
"flashflex.runtime" logger.

A third backend, "eager" (plain softmax(q k^T / sqrt(d)) v keeping the [b, heads, s, s] probabilities for the
backward), is never chosen automatically: `flashflex profile --model --attention eager` measures it, for
comparisons with implementations that materialise the attention matrix.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

LOG = logging.getLogger("flashflex.runtime")

FLASH = "flash-attn"
SDPA = "sdpa"
EAGER = "eager"


def flash_attn_available() -> bool:
    """True when the flash_attn package can be imported."""
    return importlib.util.find_spec("flash_attn") is not None


def choose_backend(device: torch.device, dtype: torch.dtype, rank: int | None = None,
                   prefer: str | None = None) -> str:
    """Pick "flash-attn" or "sdpa" for compute on `device` in `dtype`, and log the choice and the reason.

    `prefer="sdpa"` forces SDPA (for comparisons); `prefer="flash-attn"` is honoured only where supported.
    """
    reason: str
    if prefer == SDPA:
        choice, reason = SDPA, "requested"
    elif device.type != "cuda":
        choice, reason = SDPA, f"device {device.type} is not CUDA"
    elif dtype not in (torch.bfloat16, torch.float16):
        choice, reason = SDPA, f"dtype {dtype} is not bf16/fp16"
    elif torch.cuda.get_device_capability(device) < (8, 0):
        choice, reason = SDPA, f"compute capability {torch.cuda.get_device_capability(device)} < (8, 0)"
    elif not flash_attn_available():
        choice, reason = SDPA, "flash_attn is not installed"
    else:
        choice, reason = FLASH, "installed and supported"
    who = f"rank {rank}: " if rank is not None else ""
    LOG.info("%sattention backend %s (%s)", who, choice, reason)
    return choice


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d], causal."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d], causal (flash-attn handles GQA natively)."""
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]

    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        dtype = torch.bfloat16
    out = flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    return out


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d], causal, materialising the [b, hq, s, s] scores.

    The additive mask (0 on and below the diagonal, -inf above) saves nothing for the backward; softmax saves
    its [b, hq, s, s] output, which the second matmul saves again (the same storage)."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
    s = q.shape[1]
    scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)) * q.shape[-1] ** -0.5
    mask = torch.full((s, s), float("-inf"), device=q.device, dtype=scores.dtype).triu(1)
    probs = torch.softmax(scores + mask, dim=-1)
    return torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2)


def attention_fn(backend: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The causal attention function of a backend: (q [b,s,hq,d], k, v [b,s,hkv,d]) -> [b,s,hq,d]."""
    if backend == EAGER:
        return _eager
    return _flash if backend == FLASH else _sdpa

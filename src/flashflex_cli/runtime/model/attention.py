"""Attention backend: flash-attn's `flash_attn_func` where installed and supported (CUDA SM80 or newer,
bf16/fp16), else `torch.nn.functional.scaled_dot_product_attention`. Chosen per rank and logged on the
"flashflex.runtime" logger.

A third backend, "eager" (plain softmax(q k^T / sqrt(d)) v keeping the probabilities for the backward), is
never chosen automatically: `flashflex profile --model --attention eager` measures it, for comparisons with
implementations that materialise the attention matrix.

Sliding window (Mistral): with a window w, query i attends to keys j with i - w < j <= i (w keys, itself
included; the convention of transformers' `sliding_window_overlay`). Every backend honours it: flash-attn
through its `window_size` (w - 1 keys to the left); SDPA and eager, when w < s, in query blocks of w rows,
each against the w + (w - 1) keys it can reach with an explicit band mask, so compute and the eager
backend's kept probabilities ([w, 2w - 1] per block, at most 2w - 1 keys per query) follow the window, not s.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from functools import partial

import torch
from torch.nn import functional

LOG = logging.getLogger("flashflex.runtime")

FLASH = "flash-attn"
SDPA = "sdpa"
EAGER = "eager"
# The backend each attention name of a plan or a layer profile ("flash", "sdpa", "eager") asks for.
PLAN_BACKENDS = {"flash": FLASH, "sdpa": SDPA, "eager": EAGER}

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [b, s, hkv, d] repeated to q's head count (query head i uses kv head i // (hq / hkv))."""
    groups = q.shape[2] // k.shape[2]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
    return k, v


def band_mask(q_start: int, q_stop: int, k_start: int, k_stop: int, window: int,
              device: torch.device) -> torch.Tensor:
    """bool [q_stop - q_start, k_stop - k_start]: True where query i may see key j (i - window < j <= i),
    for absolute positions i in [q_start, q_stop) and j in [k_start, k_stop)."""
    i = torch.arange(q_start, q_stop, device=device).unsqueeze(1)
    j = torch.arange(k_start, k_stop, device=device).unsqueeze(0)
    return (j <= i) & (j > i - window)


def _blocks(s: int, window: int) -> list[tuple[int, int, int]]:
    """(query start, query stop, first key) of each query block of `window` rows."""
    return [(a, min(s, a + window), max(0, a - window + 1)) for a in range(0, s, window)]


def _sdpa_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [b, n, h, d], k/v [b, m, h, d], mask bool [n, m] or None (causal) -> [b, n, h, d]."""
    out = functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=mask is None)
    return out.transpose(1, 2)


def _eager_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """As `_sdpa_block`, materialising the [b, h, n, m] probabilities. The additive mask (0 where visible,
    -inf elsewhere) saves nothing for the backward; softmax saves its output, which the second matmul saves
    again (the same storage)."""
    n, m = q.shape[1], k.shape[1]
    scores = torch.matmul(q.transpose(1, 2), k.permute(0, 2, 3, 1)) * q.shape[-1] ** -0.5
    if mask is None:
        additive = torch.full((n, m), float("-inf"), device=q.device, dtype=scores.dtype).triu(1)
    else:
        additive = torch.zeros((n, m), device=q.device, dtype=scores.dtype).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores + additive, dim=-1)
    return torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2)


def _blocked(block: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             window: int | None) -> torch.Tensor:
    """Causal attention, windowed when `window` < s: q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d]."""
    k, v = _expand_kv(q, k, v)
    s = q.shape[1]
    if window is None or window >= s:
        return block(q, k, v, None)
    outs = [block(q[:, a:z], k[:, k0:z], v[:, k0:z], band_mask(a, z, k0, z, window, q.device))
            for a, z, k0 in _blocks(s, window)]
    return torch.cat(outs, dim=1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d], causal (windowed when `window` < s)."""
    return _blocked(_sdpa_block, q, k, v, window)


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d], causal (windowed when `window` < s),
    materialising the scores: [b, hq, s, s] without a window, [b, hq, w, <= 2w - 1] per block with one."""
    return _blocked(_eager_block, q, k, v, window)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """q [b, s, hq, d], k/v [b, s, hkv, d] -> [b, s, hq, d], causal (flash-attn handles GQA natively; a
    window w keeps w - 1 keys to the left of each query)."""
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]

    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        dtype = torch.bfloat16
    if window is None:
        return flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    return flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, window_size=(window - 1, 0))


def attention_fn(backend: str, window: int | None = None) -> AttentionFn:
    """The causal attention function of a backend: (q [b,s,hq,d], k, v [b,s,hkv,d]) -> [b,s,hq,d]; with
    `window`, query i sees keys i - window < j <= i only."""
    fn = _eager if backend == EAGER else _flash if backend == FLASH else _sdpa
    return fn if window is None else partial(fn, window=window)

"""Matrix products and attention of 16-bit tensors computed in fp32 and rounded once: for tests that count memory.

On a CPU without native 16-bit matrix units (AVX2 only), torch's bf16 / fp16 products take a slow path: a
[512, 2048] @ [2048, 256] product (a linear layer's input gradient, both operands row-major) runs 90x slower than in
fp32 (torch 2.13), so a few steps of a small bf16 plan take minutes. `HalfKernelsInFloat32` is a dispatch mode that
computes mm / addmm / bmm / baddbmm of bf16 or fp16 operands in fp32 and rounds the result to the operands' dtype,
which is what a 16-bit product with an fp32 accumulator returns (up to the order of the additions).

Enter it *before* (outside) `TensorAccounting`: dispatch modes handle an operation innermost first, and an
operation issued inside a mode's handler goes only to the modes below it, so the accounting sees each product's
16-bit output, as from the native kernel, and never this mode's fp32 temporaries (freed when the product returns).
The native kernels allocate no tensors the accounting could see either (their scratch space is not a tensor).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# each operation, and how many of its leading outputs are 16-bit when its inputs are (None: its one output)
_ROUNDED: dict[Any, int | None] = {
    _aten.mm.default: None, _aten.addmm.default: None, _aten.bmm.default: None, _aten.baddbmm.default: None,
    # SDPA's CPU kernel: (output, log-sum-exp in fp32) forward; the three input gradients backward
    _aten._scaled_dot_product_flash_attention_for_cpu.default: 1,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 3,
}
_HALF = (torch.bfloat16, torch.float16)


class HalfKernelsInFloat32(TorchDispatchMode):
    """Matrix products and SDPA's CPU kernel on bf16 or fp16 tensors: computed in fp32, the results rounded to
    the dtype the 16-bit kernel returns. `handled`: how many operations it computed in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.handled = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _ROUNDED:
            return func(*args, **kwargs)
        dtype = args[0].dtype
        if dtype not in _HALF:
            return func(*args, **kwargs)

        def widen(a: Any) -> Any:
            return a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a

        self.handled += 1
        out = func(*[widen(a) for a in args], **{key: widen(a) for key, a in kwargs.items()})
        rounded = _ROUNDED[func]
        if rounded is None:
            return out.to(dtype)
        return tuple(o.to(dtype) if i < rounded else o for i, o in enumerate(out))

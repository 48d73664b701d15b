"""Count what a part's operations cost besides its matrix products: a dispatch mode that sees every aten
operation and adds up the operations dispatched, those that run a kernel (not a view or an allocation), and the
bytes of the tensors each kernel other than a matrix product or the fused attention reads and writes
(cost/traffic.py's counts; scripts/count_traffic.py fits them)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# operations that launch no kernel: views, metadata, allocations without a fill
NO_KERNEL = {"view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "squeeze", "unsqueeze", "permute",
             "detach", "alias", "as_strided", "reshape", "split", "chunk", "unbind", "narrow", "view_as",
             "_reshape_alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty"}
MATMUL = {"mm", "bmm", "addmm", "matmul", "linear", "baddbmm"}
FUSED_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
                   "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
                   "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"}
ALLOCATING_FILLS = {"zeros", "ones_like", "zeros_like", "new_zeros", "fill_", "zero_", "full"}


class OpTraffic(TorchDispatchMode):
    """Counts of the operations run inside it: `ops` dispatched, `kernels` run, `bytes` moved by the kernels that
    are neither matrix products nor fused attention (inputs read plus outputs written)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.kernels = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        self.ops += 1
        if name in NO_KERNEL or name in ALLOCATING_FILLS:
            return out
        self.kernels += 1
        if name not in MATMUL and name not in FUSED_ATTENTION:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out

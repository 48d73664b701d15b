"""Count what a part's operations cost besides its matrix products: a dispatch mode that sees every aten
operation and adds up the operations dispatched, those that run a kernel (not a view or an allocation), and the
bytes of the tensors each kernel other than a matrix product or the fused attention reads and writes
(cost/traffic.py's counts; scripts/count_traffic.py fits them)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flashflex_cli.model.spec import ModelSpec
from flashflex_cli.runtime.model.precision import autocast
from flashflex_cli.runtime.model.stage import StageModule
from flashflex_cli.runtime.model.tensor_parallel import TPContext

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
    are neither matrix products nor fused attention (inputs read plus outputs written), and `matmul_bytes`, the
    operands and results of the matrix products."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.kernels = 0
        self.bytes = 0
        self.matmul_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        self.ops += 1
        if name in NO_KERNEL or name in ALLOCATING_FILLS:
            return out
        self.kernels += 1
        if name in FUSED_ATTENTION:
            return out
        moved = sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        if name in MATMUL:
            self.matmul_bytes += moved
        else:
            self.bytes += moved
        return out


# (layers, first, last) of a StageModule holding one part alone
PART_LAYOUTS = {"layer": ((0, 1), False, False), "head": ((0, 0), False, True), "embedding": ((0, 0), True, False)}


def count_part(spec: ModelSpec, part: str, b: int, s: int, dtype: str,
               chunk: int | None = None) -> tuple[OpTraffic, OpTraffic]:
    """The counted second forward and backward of one part of the runtime's model ("layer", "head", "embedding")
    on micro-batches [b, s] in `dtype` (the first builds the rotary tables and the gradients); `chunk`: the head's
    chunked loss with chunks of that many tokens (None: the whole-vocabulary loss)."""
    layers, first, last = PART_LAYOUTS[part]
    module = StageModule(spec, layers, first, last, TPContext(None), chunked_loss=chunk is not None)
    if chunk is not None:
        module.loss_chunk_tokens = chunk
    x = torch.randn(b, s, spec.hidden_size, requires_grad=True)
    tokens = torch.randint(0, spec.vocab_size, (b, s + 1))
    for _ in range(2):
        with OpTraffic() as forward, autocast(torch.device("cpu"), dtype):
            out = module(x) if part == "layer" else module(tokens[:, :-1]) if part == "embedding" else \
                module(x, tokens[:, 1:])
        grad = torch.ones_like(out)
        with OpTraffic() as backward:
            out.backward(grad)
    return forward, backward

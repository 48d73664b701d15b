"""The head's loss through torch's own fused linear cross-entropy (RuntimeOptions.loss_kernel "torch").

`torch.nn.functional.linear_cross_entropy(h, weight, targets, reduction="sum", options=LinearCrossEntropyOptions
(...))` (torch 2.13 and later) computes what runtime/model/chunked_loss.py computes at TP 1: the logits chunk by
chunk, each chunk's gradients in the forward, the backward only scaling them. It cannot take a vocabulary-sharded
weight (TP > 1 needs the per-chunk all-reduces of chunked_loss.py), so a stage of TP > 1 keeps the project's
loss whatever loss_kernel says, and so does a torch without the function.

Why it is an option and not the default (read off torch 2.13, checked on CPU in tests/test_torch_loss.py):
- with bf16 inputs its summed loss is accumulated and returned in bf16 (its output dtype is the input's, fp32
  only for fp16): over 512 tokens 4896 where the fp32 sum is 4890.25, over 26 tokens in 6 chunks 143.0 where it
  is 143.91, so the step's reported loss would carry bf16 rounding, once per chunk;
- `torch.compile` breaks its graph at the chunked op (its documentation), where the project's per-chunk
  functions compile (chunked_loss.compile_kernels);
- its "auto" accumulation policy on CUDA ("compact") adds each chunk's weight gradient into a bf16 sum; the
  "balanced" policy used here keeps an fp32 [V, H] scratch for that, and its memory is not what the cost model
  counts for the project's loss (cost/activations.py), which it is charged as.
Inputs are cast to the compute dtype first (autocast does not cast this op's inputs), and the chunk is the
project's (`semantics.runtime_paths.loss_chunk_tokens`), so both paths hold chunks of one size.
"""

from __future__ import annotations

import torch
from torch.nn import functional


def available() -> bool:
    """True when this torch has the chunked fused linear cross-entropy (torch 2.13 and later)."""
    return hasattr(functional, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def torch_head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Sum over the N tokens of the cross-entropy of h @ weight^T, a scalar in fp32 (bf16 values in bf16: module
    docstring). h [N, H], weight [V, H] (the whole vocabulary: TP 1), targets int64 [N]; matmuls in the autocast
    dtype when autocast is on (else in weight's dtype), accumulation in fp32."""
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    accumulate = torch.float32 if dtype in (torch.bfloat16, torch.float16) else None
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_tokens, chunking_method=None,
                                                 acc_policy="balanced" if accumulate else "auto",
                                                 acc_dtype=accumulate)
    with torch.autocast(device, enabled=False):
        loss = functional.linear_cross_entropy(h.to(dtype), weight.to(dtype), targets, reduction="sum",
                                               options=options)
    return loss.float()

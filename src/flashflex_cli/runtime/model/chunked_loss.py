"""The last stage's output projection and cross-entropy, in chunks of tokens, never holding [tokens, vocab] fp32
logits (RuntimeOptions.chunked_loss).

`chunked_head_loss(h, weight, targets, ...)` returns the SUM over the N tokens of the per-token cross-entropy of
logits = h @ weight^T, exactly what `vocab_parallel_cross_entropy(F.linear(h, weight), ...).sum()` returns, within
rounding: the same compute-dtype matrix product (autocast's bf16/fp16, or fp32), the same fp32 softmax. The
tokens are taken `chunk_tokens` at a time (`semantics.runtime_paths.loss_chunk_tokens`, so one chunk's fp32
logits stay within LOSS_CHUNK_BYTES), and each chunk's gradients are computed in the forward, while its logits
exist, as Liger-Kernel's fused linear cross-entropy does (Hsu et al. 2024, arXiv 2410.10989): the upstream
gradient of a summed loss is one scalar, so the backward only scales the two accumulated gradients by it. No
logits are recomputed, and the backward holds nothing of the vocabulary's size but the weight gradient.

Vocabulary parallelism (TP > 1): `weight` holds vocabulary rows [vocab_start, vocab_start + V) of this rank;
per chunk the row maximum is all-reduced (MAX), then the sum of exponentials and the target's logit (SUM), as
`tensor_parallel._VocabParallelCE` does for the whole tensor, so every rank gets the same per-token loss and the
gradient of its own logit shard. The gradient of `h` is this rank's partial sum (the caller's `copy_to_tp`
all-reduces it in the backward, as for the unchunked path). Tied embeddings: `weight` is then the embedding
shard; nothing changes here.

Memory, for N tokens of a micro-batch on this stage, V vocabulary rows on this rank (vocab / tp), H hidden,
n = chunk_tokens (the last chunk may be shorter), c bytes per element of the compute dtype (2 for bf16/fp16;
4 for fp32, where every "compute-dtype copy" below is the fp32 tensor itself and costs nothing extra):
- From the start of the forward until the backward has run (only when a gradient is needed, i.e. training):
  grad_h [N, H] in h's dtype (fp32: the final RMSNorm's output dtype) and grad_w [V, H] fp32, saved for the
  backward (`save_for_backward`, so saved-tensor hooks count them). The backward scales both in place by the
  incoming scalar gradient and returns them: grad_w becomes the weight's `.grad` (taken over without a copy
  when it has none yet, else added to it and freed), grad_h flows into the norm's backward. Nothing else is
  kept for the backward: not h, not the logits.
- During the forward only: the weight in the compute dtype, w_c [V, H] (c bytes per element; none in fp32).
- Per chunk, during the forward only, each freed before the next chunk starts (eager execution):
  h_c [n, H] compute dtype; the matrix product's output [n, V] compute dtype while it is cast to
  logits32 [n, V] fp32 (n V 4 <= LOSS_CHUNK_BYTES); one more [n, V] fp32 temporary while the sums of
  exponentials are taken; then the softmax is formed in place in logits32 and cast to the gradient
  g [n, V] compute dtype (in fp32 it is logits32 itself); the per-chunk products g w_c [n, H] and g^T h_c [V, H]
  in the compute dtype before they are added into grad_h and grad_w (in fp32, and on CUDA, they are written
  into them directly: `product_into`). So a chunk's own peak is at most 8 n V bytes (the sums: two fp32 [n, V]) or (4 + c) n V (the
  product and its fp32 cast; the softmax and g), plus c n H for h_c, and then c (n V + n H + V H) for the
  products: in bf16 at most max(8 n V, 6 n V, 2 (n V + n H + V H)) + 2 n H bytes.
- Compiled (`compile_kernels`, TP 1): the softmax and its gradient fuse into the reductions, so a chunk holds
  at most what the eager chunk holds (the product's [n, V] output and g; the fp32 chunk need not exist).
The head's peak beyond its inputs is therefore: grad_h + grad_w + w_c + one chunk's peak, during the forward.

On CUDA, where the compute dtype is 16-bit, the two gradient products are written straight into their fp32
accumulators by cuBLAS (`torch.mm` / `torch.addmm` with `out_dtype=torch.float32`, which CUDA builds of torch
2.8 and later provide; CPU builds do not): no compute-dtype [V, H] product per chunk, no separate fp32 add of it.
At the H200 shape of issue 31 (vocabulary 128256, hidden 2048, 523-token chunks, 64 chunks a step) the eager
form wrote a bf16 [V, H] product and read it back into the fp32 sum once a chunk, about 2.6 GB of traffic per
chunk, which is what the chunked loss cost (37 ms a step) over the unchunked one. The fused form only reads and
writes the fp32 accumulator. A torch without it (the call raises) falls back to the eager form, once, for the
process. Inside a compiled graph (compile scope "stage") the eager form is what is traced: inductor fuses the add
into the product's epilogue or its next pass itself.

Compilation (RuntimeOptions.compile): at TP 1 one chunk is one compiled function (product, cast, maximum, sums,
softmax gradient), reused for every chunk of every micro-batch (a second graph for a shorter last chunk). At
TP > 1 the two all-reduces of a chunk sit between the maximum and the sums and between the sums and the
gradient, so the chunk runs as three compiled functions with the collectives between them, in eager code: a
collective inside a compiled graph would need functional collectives, which these gloo and NCCL groups are not
set up for, and the three pieces keep what matters, the fused element-wise passes over the [n, V] chunk.
Written by hand because torch has no fused linear cross-entropy for vocabulary-sharded weights. Torch 2.13's
`torch.nn.functional.linear_cross_entropy` (chunked through `LinearCrossEntropyOptions`) covers TP 1 and is
available as RuntimeOptions.loss_kernel "torch" (runtime/model/torch_loss.py, which says why it is not the
default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .tensor_parallel import TPContext


def chunk_scores(h_c: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a chunk: h_c [n, H] and w [V, H] in the compute dtype -> (logits32 [n, V] fp32, row max [n]
    fp32 over this rank's vocabulary rows)."""
    logits32 = torch.mm(h_c, w.t()).float()
    return logits32, logits32.amax(dim=1)


def chunk_sums(logits32: torch.Tensor, row_max: torch.Tensor, local: torch.Tensor,
               hit: torch.Tensor) -> torch.Tensor:
    """[2, n] fp32: the sum of exp(logit - row_max) over this rank's rows, and the target's logit - row_max
    (0 where the target is not on this rank: `hit` False). `local` int64 [n]: the target's row on this rank
    (any valid row where not hit)."""
    target = logits32.gather(1, local.unsqueeze(1)).squeeze(1).sub(row_max).masked_fill(~hit, 0.0)
    sum_exp = (logits32 - row_max.unsqueeze(1)).exp_().sum(dim=1)
    return torch.stack([sum_exp, target])


def chunk_grad_logits(logits32: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor,
                      local: torch.Tensor, hit: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gradient of the chunk's summed loss with respect to its logits, softmax - one_hot(target), in `dtype`
    [n, V]; the softmax is formed in place in `logits32` (which is consumed)."""
    probs = logits32.sub_((row_max + sum_exp.log()).unsqueeze(1)).exp_()
    probs.scatter_add_(1, local.unsqueeze(1), hit.to(probs.dtype).neg().unsqueeze(1))
    return probs.to(dtype)


def chunk_whole(h_c: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TP 1: one chunk's per-token losses [n] fp32 and logit gradient [n, V] in w's dtype (targets int64 [n])."""
    logits32, row_max = chunk_scores(h_c, w)
    hit = torch.ones_like(targets, dtype=torch.bool)
    sums = chunk_sums(logits32, row_max, targets, hit)
    grad = chunk_grad_logits(logits32, row_max, sums[0], targets, hit, w.dtype)
    return sums[0].log() - sums[1], grad


@dataclass(frozen=True)
class LossKernels:
    """The per-chunk functions (eager, or compiled by `compile_kernels`)."""

    scores: Callable[..., Any] = chunk_scores
    sums: Callable[..., Any] = chunk_sums
    grad_logits: Callable[..., Any] = chunk_grad_logits
    whole: Callable[..., Any] = chunk_whole
    compiled: bool = False


EAGER_KERNELS = LossKernels()


def compile_kernels(backend: str | Callable[..., Any] = "inductor") -> LossKernels:
    """The per-chunk functions under torch.compile (static shapes: one graph per chunk length)."""

    def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, backend=backend, dynamic=False)

    return LossKernels(scores=compiled(chunk_scores), sums=compiled(chunk_sums),
                       grad_logits=compiled(chunk_grad_logits), whole=compiled(chunk_whole), compiled=True)


def _chunk(h_c: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab_start: int, tp: TPContext,
           kernels: LossKernels, need_grad: bool,
           capture: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token losses [n] fp32 (identical on every rank of the TP group) and, with `need_grad`, the logit
    gradient [n, V] of this rank's rows in w's dtype; `capture` gets the chunk's logits in w's dtype."""
    if tp.size == 1 and need_grad and capture is None:
        return kernels.whole(h_c, w, targets)
    local = targets - vocab_start
    hit = (local >= 0) & (local < w.shape[0])
    local = local.masked_fill(~hit, 0)
    logits32, row_max = kernels.scores(h_c, w)
    if capture is not None:
        capture.append(logits32.to(w.dtype, copy=True))  # a copy: the softmax is formed in place
    tp.all_reduce(row_max, op=dist.ReduceOp.MAX)
    sums = kernels.sums(logits32, row_max, local, hit)
    tp.all_reduce(sums)
    losses = sums[0].log() - sums[1]
    if not need_grad:
        return losses, None
    return losses, kernels.grad_logits(logits32, row_max, sums[0], local, hit, w.dtype)


class _FusedUpcast:
    """Whether cuBLAS's mixed-dtype product (`out_dtype=`) works in this process: None until first tried."""

    works: bool | None = None


def product_into(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor, accumulate: bool) -> None:
    """out (+)= left @ right: out [m, k] (fp32, or the operands' dtype), left [m, j], right [j, k] in the compute
    dtype. Same dtype: one `mm`/`addmm_` into `out`. 16-bit operands into fp32 on CUDA: the product upcast inside
    cuBLAS (`out_dtype`), no temporary (module docstring). Elsewhere: the product in the compute dtype [m, k],
    then copied or added into `out`."""
    if out.dtype == left.dtype:
        if accumulate:
            out.addmm_(left, right)
        else:
            torch.mm(left, right, out=out)
        return
    if out.is_cuda and _FusedUpcast.works is not False and not torch.compiler.is_compiling():
        try:
            if accumulate:
                torch.addmm(out, left, right, out_dtype=out.dtype, out=out)
            else:
                torch.mm(left, right, out_dtype=out.dtype, out=out)
            _FusedUpcast.works = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            if _FusedUpcast.works:
                raise
            _FusedUpcast.works = False
    if accumulate:
        out += left @ right
    else:
        out.copy_(left @ right)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Summed cross-entropy of h @ weight^T, gradients computed chunk by chunk in the forward (module docstring)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                vocab_start: int, tp: TPContext, chunk_tokens: int, kernels: LossKernels,
                capture: list[torch.Tensor] | None) -> torch.Tensor:
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        with torch.autocast(device, enabled=False):
            w = weight.to(dtype)
            for start in range(0, h.shape[0], chunk_tokens):
                stop = min(start + chunk_tokens, h.shape[0])
                h_c = h[start:stop].to(dtype)
                losses, grad = _chunk(h_c, w, targets[start:stop], vocab_start, tp, kernels, need_h or need_w,
                                      capture)
                loss += losses.sum()
                if grad is None:
                    continue
                if grad_h is not None:
                    product_into(grad_h[start:stop], grad, w, accumulate=False)
                if grad_w is not None:
                    product_into(grad_w, grad.t(), h_c, accumulate=True)
                del grad, h_c
        ctx.save_for_backward(grad_h, grad_w)  # so saved-tensor hooks (memory accounting) see them
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        for grad in (grad_h, grad_w):
            if grad is not None:
                grad.mul_(grad_loss)
        return grad_h, grad_w, None, None, None, None, None, None


def chunked_head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                      tp: TPContext, chunk_tokens: int, kernels: LossKernels = EAGER_KERNELS,
                      capture: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Sum over tokens of the cross-entropy of logits h @ weight^T, as an fp32 scalar (identical on every rank
    of the TP group). h [N, H] (replicated over the group; its gradient is this rank's part), weight [V, H]
    holding vocabulary rows [vocab_start, vocab_start + V), targets int64 [N] (global token ids). The logits
    are formed `chunk_tokens` tokens at a time in the autocast dtype when autocast is on (else in weight's
    dtype); `capture` (tests) receives each chunk's logits [n, V] in that dtype."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    return _ChunkedHeadLoss.apply(h, weight, targets, vocab_start, tp, chunk_tokens, kernels, capture)

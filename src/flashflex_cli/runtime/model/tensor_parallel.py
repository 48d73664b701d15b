"""Tensor parallelism (Megatron-LM style, Shoeybi et al. 2019) with the process group passed in explicitly.

Conventions: weights are stored like `torch.nn.Linear` ([out_features, in_features]). A column-parallel linear
holds rows [start, stop) of the full weight (output features split), a row-parallel linear holds columns
[start, stop) (input features split). Shard bounds come from `semantics/parameters.shard_bounds`, so a shard of a TP-2 group is exactly
the union of two shards of a TP-4 group.

Autograd operators (identity when the group has one rank):
- `copy_to_tp`: forward identity, backward all-reduce (input of a column-parallel linear);
- `reduce_from_tp`: forward all-reduce, backward identity (output of a row-parallel linear);
  both in-place on the process group (timed, mutable for a compile warm-up), or, for a stage compiled whole, as
  functional collectives torch.compile traces (`TPContext.trace_collectives`);
- `vocab_parallel_embedding`, `vocab_parallel_cross_entropy`: vocabulary split along dim 0 of the weight.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.nn import functional


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:  # type: ignore[override]
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.tp.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:  # type: ignore[override]
        return tp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


class _TracedCopyToTP(torch.autograd.Function):
    """`_CopyToTP` with a functional all-reduce (torch.distributed._functional_collectives), which torch.compile
    traces into its graph: a new tensor, no in-place call on the process group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        # a copy, not a view: a view leaving a compiled graph (the head's input, where the loss breaks the graph) is
        # replayed outside it by AOTAutograd, which loses this backward's all-reduce (inside a graph the compiler
        # removes the copy)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return funcol.all_reduce(grad.contiguous(), "sum", ctx.group), None


class _TracedReduceFromTP(torch.autograd.Function):
    """`_ReduceFromTP` with a functional all-reduce (see `_TracedCopyToTP`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        return funcol.all_reduce(x.contiguous(), "sum", group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def _traced_copy_apply(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _TracedCopyToTP.apply(x, tp.group)


def _traced_reduce_apply(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _TracedReduceFromTP.apply(x, tp.group)


def _copy_apply(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _CopyToTP.apply(x, tp)


def _reduce_apply(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp)


@dataclass
class TPContext:
    """This rank's tensor-parallel group: the group (None when size 1), its size, this rank's index in it.

    `comm_seconds` accumulates wall time spent in TP collectives (seconds; meaningful on CPU only, where
    collectives are synchronous). `muted`: collectives do nothing (a compile warm-up on dummy inputs, whose
    values do not matter, so a rank whose compilation fails cannot leave its group inside a collective).
    `copy_fn` / `reduce_fn`: how `copy_to_tp` / `reduce_from_tp` apply their collective for size > 1
    (`keep_collectives_eager` makes torch.compile run them outside its graphs).
    """

    group: dist.ProcessGroup | None
    size: int = 1
    rank: int = 0
    comm_seconds: float = 0.0
    muted: bool = False
    copy_fn: Callable[[torch.Tensor, TPContext], torch.Tensor] = field(default=_copy_apply, repr=False,
                                                                        compare=False)
    reduce_fn: Callable[[torch.Tensor, TPContext], torch.Tensor] = field(default=_reduce_apply, repr=False,
                                                                          compare=False)

    @torch.compiler.disable
    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """All-reduce `x` in place over the group (no-op for size 1 or when muted); returns `x`. Never traced by
        torch.compile (a graph break where a compiled region calls it: the vocabulary-parallel loss's reductions),
        so a compiled graph does not depend on `muted`."""
        if self.size > 1 and not self.muted:
            start = time.perf_counter()
            dist.all_reduce(x, op=op, group=self.group)
            self.comm_seconds += time.perf_counter() - start
        return x

    def keep_collectives_eager(self) -> None:
        """Make torch.compile break its graph at each TP collective and run it as plain Python (its timing and
        the process group's own call), instead of tracing into it."""
        import torch.compiler

        self.copy_fn = torch.compiler.disable(_copy_apply)
        self.reduce_fn = torch.compiler.disable(_reduce_apply)

    def plain_collectives(self) -> None:
        """`copy_to_tp` / `reduce_from_tp` as built: the in-place, timed all-reduces (an eager stage)."""
        self.copy_fn = _copy_apply
        self.reduce_fn = _reduce_apply

    def trace_collectives(self) -> None:
        """Make `copy_to_tp` / `reduce_from_tp` functional all-reduces that torch.compile traces into its graph (a
        stage compiled whole at TP > 1): no graph break at them, so the compiler sees across a layer's collectives;
        they are then neither timed (`comm_seconds`) nor muted (a warm-up runs them on every rank of the group)."""
        self.copy_fn = _traced_copy_apply
        self.reduce_fn = _traced_reduce_apply


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient backward (a replicated input feeding sharded compute)."""
    return x if tp.size == 1 else tp.copy_fn(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """All-reduce (sum) of partial results forward; identity backward."""
    return x if tp.size == 1 else tp.reduce_fn(x, tp)


def column_linear(x: torch.Tensor, weight: torch.Tensor, tp: TPContext, copy_input: bool = True) -> torch.Tensor:
    """Column-parallel linear: x [..., in] replicated -> [..., out/tp] local. weight [out/tp, in].

    Pass `copy_input=False` when `x` already went through `copy_to_tp` (several linears sharing one input).
    """
    if copy_input:
        x = copy_to_tp(x, tp)
    return functional.linear(x, weight)


def row_linear(x: torch.Tensor, weight: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Row-parallel linear: x [..., in/tp] local -> [..., out] replicated (all-reduced). weight [out, in/tp]."""
    return reduce_from_tp(functional.linear(x, weight), tp)


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                             tp: TPContext) -> torch.Tensor:
    """Embedding lookup with the vocabulary split over TP ranks.

    tokens int64 [b, s]; weight [vocab_local, hidden] holding rows [vocab_start, vocab_start + vocab_local).
    Returns [b, s, hidden], replicated over the group (tokens outside the local range contribute zeros).
    """
    if tp.size == 1:
        return functional.embedding(tokens, weight)
    local = tokens - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    out = functional.embedding(local.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(out, tp)


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-sharded logits, without gathering them."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,  # type: ignore[override]
                tp: TPContext) -> torch.Tensor:
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        tp.all_reduce(local_max, op=dist.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local = targets - vocab_start
        outside = (local < 0) | (local >= logits.shape[-1])
        safe = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        both = torch.stack([sum_exp, target_logit])
        tp.all_reduce(both)
        sum_exp, target_logit = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), safe, outside)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        softmax, safe, outside = ctx.saved_tensors
        g = softmax.clone()
        hit = (~outside).to(g.dtype)
        g.scatter_add_(-1, safe.unsqueeze(-1), -hit.unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 tp: TPContext) -> torch.Tensor:
    """Cross-entropy per token (fp32, [N]) from logits [N, vocab_local] covering [vocab_start, +vocab_local).

    Identical on every rank of the group; the backward gives each rank the gradient of its own logit shard.
    """
    if tp.size == 1:
        return functional.cross_entropy(logits.float(), targets, reduction="none")
    return _VocabParallelCE.apply(logits, targets, vocab_start, tp)

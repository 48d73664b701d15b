"""Working weights: the stage's matmul weights cast to the compute dtype once per step (RuntimeOptions.cast_once).

Under torch.autocast every `functional.linear(x, weight)` of an fp32 weight casts the weight to bf16/fp16, and
the cast is kept by that micro-batch's graph for its backward: with k micro-batches in flight a stage holds k
16-bit copies of each decoder-layer weight (autocast's weight cache lives only as long as one autocast region,
and the runtime enters one per forward). `WorkingWeights.cast` instead casts each decoder-layer matrix (q, k, v,
output, gate, up, down) once, before the step's schedule, into `module.working[name]`; the layers multiply by
`shared_cast(param, working)` (runtime/model/stage.py `Matmuls.weight`), and autocast leaves a tensor already
in its dtype as it is. After the step's last forward on the stage the module lets go of them (`forwards`), so
each copy lives on only in the saved tensors of the backwards still to run and is freed when the last of them
has passed its layer, as autocast's copies are; with activation recompute, whose backwards multiply again, they
are kept until the schedule ends. Either way the optimizer step, which updates the fp32 master weights, is
followed by a fresh cast at the next step: the copies never go stale.

Gradients: `shared_cast` is an autograd node made at each use, right before its matrix product, exactly where
autocast puts its cast: its forward returns the shared copy (a view, no new memory) and its backward casts the
product's 16-bit weight gradient to fp32, which AccumulateGrad adds into the fp32 parameter's `.grad`. So every
micro-batch's weight gradient is computed in the compute dtype and summed in fp32 as under autocast, at the same
moment of the backward (the parameters' post-accumulate-grad hooks, hence the overlapped DP reduction, fire as
before), operation for operation the same arithmetic; only the copy is shared. (One cast node for the whole step
would run its backward last in every micro-batch's backward, autograd ordering nodes by creation, and hold every
layer's 16-bit gradient until then.) Megatron-LM keeps 16-bit working weights beside fp32 main gradients the
same way (Shoeybi et al. 2019).

Not cast here: the embedding (a lookup, which autocast does not cast), the norms and biases (vectors), and the
output projection: the chunked loss holds its 16-bit copy only during its own forward
(runtime/model/chunked_loss.py), and the whole-vocabulary loss keeps autocast's copy per micro-batch as before.

Written by hand because torch has no per-step cast shared by several graphs: autocast's cache is per region,
`torch.func.functional_call` swaps tensors for one call, and FSDP's mixed precision casts per forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

# The decoder layer's matrices, by module: runtime/model/stage.py's Attention and SwiGLU.
MATMUL_WEIGHTS: dict[str, tuple[str, ...]] = {"attn": ("wq", "wk", "wv", "wo"), "mlp": ("w_gate", "w_up", "w_down")}


class _SharedCast(torch.autograd.Function):
    """forward(param fp32, working 16-bit copy) -> the copy (a view); backward: the gradient in param's dtype."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, working: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.param_dtype = param.dtype
        return working.view_as(working)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad.to(ctx.param_dtype), None


def shared_cast(param: torch.Tensor, working: torch.Tensor) -> torch.Tensor:
    """`working` (param's 16-bit copy, same shape) standing for `param` in one product: its gradient flows into
    `param` in param's dtype."""
    return _SharedCast.apply(param, working)


class WorkingWeights:
    """The 16-bit working copies of `stage`'s decoder-layer matmul weights in `dtype` (bf16 or fp16), made by
    `cast`. `stage`: a module with `layers` (runtime/model/stage.py StageModule), whose forwards are counted."""

    def __init__(self, stage: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.slots: list[tuple[nn.Module, str]] = [
            (getattr(layer, part), name) for layer in stage.layers for part, names in MATMUL_WEIGHTS.items()
            for name in names]
        self.forwards_left: int | None = None  # forwards until the module lets go of the copies (None: never)
        stage.register_forward_hook(self._after_forward)

    def _after_forward(self, *_: object) -> None:
        if self.forwards_left is not None:
            self.forwards_left -= 1
            if self.forwards_left <= 0:
                self._let_go()

    def _let_go(self) -> None:
        for owner, _ in self.slots:
            owner.working.clear()

    def copy_bytes(self) -> int:
        """Bytes the copies take while `cast` is active: the slots' elements x the dtype's bytes."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(getattr(owner, name).numel() * size for owner, name in self.slots)

    @contextmanager
    def cast(self, forwards: int | None = None) -> Iterator[None]:
        """Within: each slot's module holds `working[name]`, its weight cast to `dtype` (no autograd history),
        until `forwards` forwards of the stage have run (None: until the end); after: none."""
        self.forwards_left = forwards
        try:
            with torch.no_grad():
                for owner, name in self.slots:
                    owner.working[name] = getattr(owner, name).to(self.dtype)
            yield
        finally:
            self.forwards_left = None
            self._let_go()

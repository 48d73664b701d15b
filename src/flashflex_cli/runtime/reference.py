"""Single-process reference: the same model from the same seed, trained on the same global batches with
torch's AdamW and clip_grad_norm_, one device, no parallelism. The parity tests compare every plan to it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.spec import ModelSpec
from .attention import SDPA
from .init import full_init
from .model import StageModule
from .optimizer import OptimConfig, lr_at, set_lr
from .tensor_parallel import TPContext


@dataclass
class ReferenceRun:
    """Per-step global mean losses, full gradients (after clipping) of every step, final full parameters."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def build_reference(spec: ModelSpec, seed: int) -> StageModule:
    """The whole model (all layers, embedding and head) on one process, initialised from `seed`."""
    module = StageModule(spec, (0, spec.num_layers), True, True, TPContext(group=None), SDPA)
    with torch.no_grad():
        for info, param in module.global_parameters():
            param.copy_(full_init(spec, info.name, info.shape, seed))
    return module


def reference_train(spec: ModelSpec, batches: list[torch.Tensor], optim: OptimConfig,
                    seed: int = 0) -> ReferenceRun:
    """Train on `batches` (each int64 [global_batch, seq_len + 1]) one optimizer step per batch, fp32 CPU.

    loss = sum of per-token cross-entropy over the whole batch / its token count.
    """
    module = build_reference(spec, seed)
    named = [(info.name, p) for info, p in module.global_parameters()]
    # torch's single-tensor AdamW (the runtime runs its fused or foreach kernels), same decay grouping.
    optimizer = torch.optim.AdamW(
        [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": optim.weight_decay},
         {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr_at(0, optim), betas=optim.betas, eps=optim.eps, foreach=False)
    run = ReferenceRun()
    for step, batch in enumerate(batches):
        set_lr(optimizer, lr_at(step, optim))
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        loss = module(inputs, targets) / targets.numel()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], optim.grad_clip if optim.grad_clip > 0
                                              else float("inf"))
        run.losses.append(float(loss.item()))
        run.grad_norms.append(float(norm))
        run.grads.append({name: p.grad.detach().clone() for name, p in named if p.grad is not None})
        optimizer.step()
    run.params = {name: p.detach().clone() for name, p in named}
    return run

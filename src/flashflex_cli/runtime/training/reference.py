"""Single-process reference: the same model from the same seed, trained on the same global batches with
torch's AdamW and clip_grad_norm_, one device, no parallelism. The parity tests compare every plan to it.

In a 16-bit dtype it is the plain torch mixed-precision loop: the forward under torch.autocast, and in fp16 a
torch.amp.GradScaler (scale the loss, unscale_, clip, step, update), the loop every rank of a plan must agree
with (runtime/training/loss_scale.py)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from ...model.spec import ModelSpec
from ..model.attention import SDPA
from ..model.init import full_init
from ..model.precision import autocast, autocast_dtype
from ..model.stage import StageModule
from ..model.tensor_parallel import TPContext
from .loss_scale import LossScaling, poison
from .optimizer import OptimConfig, lr_at, set_lr


@dataclass
class ReferenceRun:
    """Per-step global mean losses, gradient norms (before clipping), full gradients (after clipping) of every
    step, final full parameters; in fp16 the scale each step's loss was multiplied by and whether the step was
    skipped (inf/NaN gradients)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    loss_scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)


def build_reference(spec: ModelSpec, seed: int, chunked_loss: bool = False) -> StageModule:
    """The whole model (all layers, embedding and head) on one process, initialised from `seed`."""
    module = StageModule(spec, (0, spec.num_layers), True, True, TPContext(group=None), SDPA,
                         chunked_loss=chunked_loss)
    with torch.no_grad():
        for info, param in module.global_parameters():
            param.copy_(full_init(spec, info.name, info.shape, seed))
    return module


def reference_train(spec: ModelSpec, batches: list[torch.Tensor], optim: OptimConfig, seed: int = 0,
                    dtype: str = "fp32", scaling: LossScaling | None = None, overflow_steps: Collection[int] = (),
                    chunked_loss: bool = False) -> ReferenceRun:
    """Train on `batches` (each int64 [global_batch, seq_len + 1]) one optimizer step per batch on the CPU, in
    `dtype` (fp32; bf16 or fp16 autocast over fp32 weights; fp16 with GradScaler's dynamic loss scaling,
    `scaling`, default torch's settings). `overflow_steps`: steps whose first gradient is made inf before the
    unscale (the runtime's test injection). The learning rate of step k is lr_at(k), skipped or not.

    loss = sum of per-token cross-entropy over the whole batch / its token count.
    """
    module = build_reference(spec, seed, chunked_loss)
    named = [(info.name, p) for info, p in module.global_parameters()]
    # torch's single-tensor AdamW (the runtime runs its fused or foreach kernels), same decay grouping.
    optimizer = torch.optim.AdamW(
        [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": optim.weight_decay},
         {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr_at(0, optim), betas=optim.betas, eps=optim.eps, foreach=False)
    cpu = torch.device("cpu")
    scaler = None
    if autocast_dtype(dtype) == torch.float16:
        config = scaling or LossScaling()
        scaler = torch.amp.GradScaler("cpu", init_scale=config.init_scale, growth_factor=config.growth_factor,
                                      backoff_factor=config.backoff_factor, growth_interval=config.growth_interval)
    run = ReferenceRun()
    for step, batch in enumerate(batches):
        set_lr(optimizer, lr_at(step, optim))
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with autocast(cpu, dtype):
            loss = module(inputs, targets) / targets.numel()
        if scaler is None:
            loss.backward()
        else:
            run.loss_scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            if step in overflow_steps:
                poison([p.grad for _, p in named if p.grad is not None])
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], optim.grad_clip if optim.grad_clip > 0
                                              else float("inf"))
        run.losses.append(float(loss.item()))
        run.grad_norms.append(float(norm))
        run.grads.append({name: p.grad.detach().clone() for name, p in named if p.grad is not None})
        if scaler is None:
            optimizer.step()
        else:
            run.skipped.append(bool(sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())))
            scaler.step(optimizer)
            scaler.update()
    run.params = {name: p.detach().clone() for name, p in named}
    return run

"""AdamW (Loshchilov & Hutter 2019) with fp32 master weights and a warm-up + cosine learning-rate schedule.

Parameters are kept in fp32 (the master weights); on GPU the compute runs under bf16 autocast, so no separate
low-precision copy exists. Weight decay applies to matrices (2-D and more: projections, embedding, head), not
to norm weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InputError


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer settings. lr and min_lr are peak and final learning rates; steps count optimizer steps."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 10
    total_steps: int = 1000
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise InputError(f"learning rates must satisfy 0 <= min_lr <= lr, 0 < lr (lr {self.lr}, "
                             f"min_lr {self.min_lr})")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise InputError("warmup_steps must be >= 0 and total_steps >= 1")
        if self.grad_clip < 0:
            raise InputError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate of the optimizer step taken after `step` completed steps (0 for the first step).

    Linear warm-up to `lr` over `warmup_steps` steps (step k uses lr * (k + 1) / warmup_steps), then cosine
    decay to `min_lr` at `total_steps`, constant `min_lr` after.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


class AdamW:
    """AdamW over fp32 parameters, the update of torch.optim.AdamW (decoupled weight decay, bias correction)
    without importing torch.optim (whose import pulls in torch._dynamo, seconds per process).

    `param_groups`: [{"params": [...], "weight_decay": float, "lr": float}]; `state[param]`: {"exp_avg",
    "exp_avg_sq"} fp32 tensors like the parameter, created at the first step; `steps`: steps taken.
    """

    def __init__(self, groups: list[dict[str, Any]], lr: float, betas: tuple[float, float], eps: float) -> None:
        self.param_groups = [{**g, "lr": lr} for g in groups]
        self.betas, self.eps = betas, eps
        self.state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        self.steps = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every gradient."""
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        self.steps += 1
        beta1, beta2 = self.betas
        bias1 = 1.0 - beta1 ** self.steps
        bias2_sqrt = math.sqrt(1.0 - beta2 ** self.steps)
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for param in params:
                if param not in self.state:
                    self.state[param] = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            grads = [p.grad for p in params]
            exp_avg = [self.state[p]["exp_avg"] for p in params]
            exp_avg_sq = [self.state[p]["exp_avg_sq"] for p in params]
            # Multi-tensor (foreach) kernels: the element-wise math of torch.optim.AdamW, few kernel launches.
            if decay:
                torch._foreach_mul_(params, 1.0 - lr * decay)
            torch._foreach_lerp_(exp_avg, grads, 1.0 - beta1)
            torch._foreach_mul_(exp_avg_sq, beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1.0 - beta2)
            denom = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(denom, bias2_sqrt)
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(params, exp_avg, denom, value=-lr / bias1)


def make_optimizer(named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig) -> AdamW:
    """AdamW over fp32 parameters: decay on matrices, none on norm weights (1-D)."""
    decay, no_decay = [], []
    for _, param in named_params:
        (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return AdamW(groups, lr=lr_at(0, cfg), betas=cfg.betas, eps=cfg.eps)


def set_lr(optimizer: AdamW | torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr

"""AdamW (Loshchilov & Hutter 2019, torch.optim.AdamW) with fp32 master weights and a warm-up + cosine
learning-rate schedule.

Parameters are kept in fp32 (the master weights); the compute runs under autocast in the plan's 16-bit dtype,
so no separate low-precision copy exists. Weight decay applies to matrices (2-D and more: projections,
embedding, head), not to norm weights. The update is torch's own (fused kernel or multi-tensor kernels,
`RuntimeOptions.optimizer`); this module only groups the parameters, schedules the learning rate and restores
a checkpoint's moments. The settings (OptimConfig) are part of the run configuration (run_config.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ...run_config import OptimConfig


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


def make_optimizer(named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig,
                   path: str = "foreach") -> torch.optim.AdamW:
    """torch.optim.AdamW over fp32 parameters: decay on matrices (2-D and more), none on norm weights (1-D).

    `path` "fused": one fused kernel for the whole update (CUDA and CPU); "foreach": torch's multi-tensor
    kernels (several passes, temporaries as large as the parameters). Both compute the same update.
    Per-parameter state: "step" (a 0-d float32 tensor, on the parameter's device when fused, on the CPU
    otherwise), "exp_avg", "exp_avg_sq" (fp32, like the parameter), created at the first step."""
    if path not in ("fused", "foreach"):
        raise ValueError(f"optimizer path must be fused or foreach, got {path!r}")
    decay, no_decay = [], []
    for _, param in named_params:
        (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr_at(0, cfg), betas=cfg.betas, eps=cfg.eps,
                             fused=path == "fused", foreach=path == "foreach")


def restore_moments(optimizer: torch.optim.AdamW, param: torch.nn.Parameter, steps: int,
                    exp_avg: torch.Tensor | None = None, exp_avg_sq: torch.Tensor | None = None) -> None:
    """Give `param` the AdamW state of a run that took `steps` optimizer steps (a checkpoint's moments, which
    become the state itself: no copy); with `steps` 0 the parameter starts fresh (no state)."""
    if steps <= 0:
        optimizer.state.pop(param, None)
        return
    if exp_avg is None or exp_avg_sq is None:
        raise ValueError(f"restoring step {steps} needs both AdamW moments")
    # the "step" tensor torch.optim.AdamW itself creates: float32 on the parameter's device when fused, else a
    # CPU scalar (float64 only under a float64 default dtype)
    if optimizer.defaults.get("fused"):
        step = torch.tensor(float(steps), dtype=torch.float32, device=param.device)
    else:
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        step = torch.tensor(float(steps), dtype=dtype)
    optimizer.state[param] = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr

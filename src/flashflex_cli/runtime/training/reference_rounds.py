"""Single-process reference of low-communication training (DiLoCo, arXiv 2311.08105, Algorithm 1): what a plan of
replica groups must compute, written as plainly as the math, for the parity tests.

Every group is one full model on one process with its own AdamW (the reference loop's settings: decay on
matrices only, clip_grad_norm_, lr_at(step) of the group's own inner step count). A round: each group trains its
inner steps on its batches; pseudo-gradient_g = global - local_g; the outer gradient is sum_g weight_g *
pseudo-gradient_g, each term rounded to the wire dtype first (as the runtime sends it); torch.optim.SGD with
Nesterov momentum steps the global parameters; every group copies them.

Streamed fragments (semantics/outer_sync.py, `fragments` F > 1): the round's groups advance together fragment by
fragment: for f = 0..F-1, each group g trains up to its inner step `fragment_sync_step(H_g, f, F)`, then the
above outer step is taken for fragment f's parameters only (their pseudo-gradients, global parameters, momentum).

Overlap (`overlap` tau > 0): fragment f's outer gradient is computed at its sync step as above, but the outer step
and the merge (parameter = alpha * local + (1 - alpha) * global) wait until each group has trained tau more inner
steps; the last fragment's are carried into the next round (after its inner step tau), and finished at once before
a resume (`resumed_after`: the checkpoint finished it) and after the last round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...model.spec import ModelSpec
from ...semantics.outer_sync import fragment_sync_step, param_fragment
from .optimizer import OptimConfig, lr_at, set_lr
from .reference import build_reference


@dataclass
class ReferenceRounds:
    """Per round: each group's inner losses; the global parameters after the last round."""

    group_losses: list[list[list[float]]] = field(default_factory=list)  # [round][group][inner step]
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def reference_rounds(spec: ModelSpec, batches: list[list[list[torch.Tensor]]], weights: list[float],
                     optim: OptimConfig, outer_lr: float, outer_momentum: float, seed: int = 0,
                     wire_dtype: torch.dtype = torch.float32, resumed_after: int | None = None,
                     fragments: int = 1, overlap: int = 0, alpha: float = 0.0) -> ReferenceRounds:
    """Train `len(batches)` rounds; `batches[r][g][k]`: group g's batch at inner step k of round r, int64
    [sequences, seq_len + 1]; `weights[g]`: group g's share of the round's tokens. fp32 on the CPU.
    `resumed_after`: after that many rounds every group takes group 0's AdamW moments (keeping its own step
    count) and its parameters (the global ones, but for fragments mid-way between outer steps), as a resume from a
    checkpoint does (runtime/training/rounds.py). `fragments`: streamed fragments; `overlap`, `alpha`: inner steps
    each exchange overlaps and the merge's mixing factor (module docstring)."""
    groups = len(weights)
    models = [build_reference(spec, seed) for _ in range(groups)]
    named = [[(info.name, p) for info, p in model.global_parameters()] for model in models]
    optimizers = [torch.optim.AdamW(
        [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
         {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=lr_at(0, optim), betas=optim.betas, eps=optim.eps, foreach=False) for params in named]
    global_params = {name: p.detach().clone() for name, p in named[0]}
    outer = torch.optim.SGD(list(global_params.values()), lr=outer_lr, momentum=outer_momentum,
                            nesterov=outer_momentum > 0)
    steps = [0] * groups
    fragment_of = {name: param_fragment(name, spec.num_layers, fragments) for name in global_params}
    run = ReferenceRounds()

    def outer_gradient(fragment: int) -> dict[str, torch.Tensor]:
        """Fragment `fragment`'s outer gradient now: sum_g weight_g * (global - local_g), each term in the wire
        dtype."""
        with torch.no_grad():
            return {name: sum(((anchor - dict(named[g])[name]) * weights[g]).to(wire_dtype).float()
                              for g in range(groups))
                    for name, anchor in global_params.items() if fragment_of[name] == fragment}

    def apply(fragment: int, grads: dict[str, torch.Tensor]) -> None:
        """The outer step of fragment `fragment` with `grads`, merged into every group's parameters."""
        with torch.no_grad():
            for name, anchor in global_params.items():
                anchor.grad = grads.get(name)
            outer.step()  # anchors of the other fragments have no gradient: untouched
            for g in range(groups):
                for name, param in named[g]:
                    if fragment_of[name] == fragment:
                        if alpha == 0.0:
                            param.copy_(global_params[name])
                        else:
                            param.mul_(alpha).add_(global_params[name], alpha=1.0 - alpha)

    def train_until(round_batches: list[list[torch.Tensor]], until: list[int]) -> None:
        """Every group g's inner steps of the current round up to its step `until[g]` (exclusive, 0-based)."""
        for g in range(groups):
            _inner_steps(models[g], named[g], optimizers[g], optim, round_batches[g], steps, g, until[g],
                         run.group_losses[-1][g])

    carried: tuple[int, dict[str, torch.Tensor]] | None = None  # the last fragment's exchange in flight
    for index, round_batches in enumerate(batches):
        if index == resumed_after:
            if carried is not None:
                apply(*carried)
                carried = None
            for g in range(1, groups):
                for (_, mine), (_, first) in zip(named[g], named[0], strict=True):
                    state, source = optimizers[g].state[mine], optimizers[0].state[first]
                    state["exp_avg"], state["exp_avg_sq"] = source["exp_avg"].clone(), source["exp_avg_sq"].clone()
                    with torch.no_grad():
                        mine.copy_(first)
        run.group_losses.append([[] for _ in range(groups)])
        sync = [[fragment_sync_step(len(mine), f, fragments) for f in range(fragments)] for mine in round_batches]
        if carried is not None:
            train_until(round_batches, [overlap] * groups)
            apply(*carried)
            carried = None
        for fragment in range(fragments):
            train_until(round_batches, [at[fragment] for at in sync])
            grads = outer_gradient(fragment)
            if fragment == fragments - 1 and overlap > 0:
                carried = (fragment, grads)
                continue
            train_until(round_batches, [at[fragment] + overlap for at in sync])
            apply(fragment, grads)
    if carried is not None:
        apply(*carried)
    run.params = {name: p.detach().clone() for name, p in global_params.items()}
    return run


def _inner_steps(model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]],
                 optimizer: torch.optim.Optimizer, optim: OptimConfig, batches: list[torch.Tensor], steps: list[int],
                 g: int, until: int, losses: list[float]) -> None:
    """Group `g`'s inner steps of the round from `len(losses)` up to `until` (exclusive, 0-based), appending their
    losses; `steps[g]` counts the group's inner steps over the run (its learning rate schedule)."""
    for batch in batches[len(losses):until]:
        set_lr(optimizer, lr_at(steps[g], optim))
        optimizer.zero_grad(set_to_none=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        loss = model(inputs, targets) / targets.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in named], optim.grad_clip if optim.grad_clip > 0 else float("inf"))
        optimizer.step()
        losses.append(float(loss.item()))
        steps[g] += 1

"""Dynamic loss scaling for fp16 plans, global to the job: one scale, the same on every rank.

An fp16 plan computes under autocast in fp16 over fp32 master weights; gradients smaller than fp16's least
subnormal (2^-24, about 6e-8) would flush to zero in the fp16 backward, so the loss is multiplied by a scale S
(a power of two) and the gradients are divided by S before anything reads them. A step whose gradients hold an
inf or NaN anywhere in the job is skipped by every rank and S is halved; after `growth_interval` clean steps in a
row S doubles. These are the semantics of `torch.amp.GradScaler` (Micikevicius et al., "Mixed Precision
Training", ICLR 2018), and GradScaler does the per-rank work here (its settings, LossScaling, are part of the run
configuration: run_config.py):

- `scale(loss)`: GradScaler.scale on the last stage's loss (already multiplied by 1 / global tokens);
- `unscale_and_agree()`: GradScaler.unscale_ after the data-parallel reduction (this rank's gradients divided by
  S, in place, and checked for inf/NaN by `_amp_foreach_non_finite_check_and_unscale_`), then this rank's
  found-inf flag (GradScaler's `_found_inf_per_device`) is all-reduced with MAX over the world group, in place;
- `step()` and `update()`: GradScaler.step (skips optimizer.step() when the flag is set: with fused AdamW the flag
  goes into the kernel, no host read; with foreach AdamW GradScaler reads it, a host sync on CUDA) and
  GradScaler.update (`_amp_update_scale_`: backoff or growth from the same flag).

What GradScaler cannot do, written here: it works per process and per optimizer, and decides from the gradients
it sees. In an asymmetric plan every rank holds other parameters (other stages, TP shards, pipelines), so one
rank's inf must stop every rank's step and move every rank's scale, or the replicas and stages would drift apart
(a skipped update on one pipeline only; scales that differ between the stage that scales the loss and the stages
that unscale it). Hence the one MAX all-reduce of the flag over the world group, between unscale_ and step, so
every rank's GradScaler then acts on the job's flag; every rank starts from the same scale (initial, or the
checkpoint's) and applies the same updates, so the scale stays identical everywhere without being sent. The
flag is a separate small collective, run only by fp16 plans; bf16 and fp32 plans create no scaler.

The learning-rate schedule follows iterations, as in a torch loop that calls its scheduler every iteration
(GradScaler leaves the scheduler to the caller): a skipped step consumes its batch and its slot of the schedule,
on every rank alike and in the one-device reference (runtime/training/reference.py). AdamW's own step count (its bias
correction) counts the updates actually taken; the engine keeps that count ("optimizer_steps" in checkpoints).

Test injection: FLASHFLEX_OVERFLOW_INJECT="rank=R,step=K" makes plan rank R's first local gradient inf at step K
(counted from 0, as FLASHFLEX_FAULT_INJECT), after the data-parallel reduction, so only that rank sees it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import InputError
from ...run_config import LossScaling
from ...semantics.worker_protocol import parse_injection

INJECT_ENV = "FLASHFLEX_OVERFLOW_INJECT"
SCALE_KEY = "loss_scale"  # checkpoint keys: fp32 scalar (the scale the next step uses) ...
TRACKER_KEY = "loss_scale_growth_tracker"  # ... and int32 scalar (clean steps in a row since the last change)


class JobScaler:
    """One rank's torch.amp.GradScaler over `optimizer`, agreeing with every rank of `world_group` on whether a
    step overflowed (module docstring). Call per step: `scale` (last stage), then after the gradients are
    reduced `unscale_and_agree`, `step`, `update`."""

    def __init__(self, config: LossScaling, device: torch.device, optimizer: torch.optim.Optimizer,
                 world_group: dist.ProcessGroup | None) -> None:
        self.config, self.optimizer, self.world_group = config, optimizer, world_group
        self.scaler = torch.amp.GradScaler(device.type, init_scale=config.init_scale,
                                           growth_factor=config.growth_factor,
                                           backoff_factor=config.backoff_factor,
                                           growth_interval=config.growth_interval)
        # GradScaler creates its scale and growth-tracker tensors on the first scale() call; ranks that scale
        # no loss (every stage but the last) unscale too, so every rank makes that call now, on its device.
        self.scaler.scale(torch.ones((), device=device))

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the current scale (a device multiply, no host read)."""
        return self.scaler.scale(loss)

    def current(self) -> torch.Tensor:
        """A copy of the current scale (fp32 device scalar): read it before `update` for the step's scale."""
        return self.scaler._get_scale_async().clone()  # type: ignore[union-attr]

    def unscale_and_agree(self) -> torch.Tensor:
        """Divide this rank's gradients by the scale, check them for inf/NaN, and make the flag the job's (MAX
        over the world group, in place in GradScaler's record, so `step` and `update` act on it). Returns the
        flag: an fp32 device scalar, 1 when some rank's gradients overflowed."""
        self.scaler.unscale_(self.optimizer)
        flags = list(self.scaler._found_inf_per_device(self.optimizer).values())
        if len(flags) != 1:  # one device per rank: parameters all live there
            raise RuntimeError(f"expected this rank's gradients on one device, found {len(flags)} devices")
        dist.all_reduce(flags[0], op=dist.ReduceOp.MAX, group=self.world_group)
        return flags[0]

    def step(self) -> None:
        """The optimizer step, skipped on every rank when the job's flag is set."""
        self.scaler.step(self.optimizer)

    def update(self) -> None:
        """Halve the scale after an overflow, double it after `growth_interval` clean steps in a row."""
        self.scaler.update()

    def state(self) -> dict[str, torch.Tensor]:
        """Checkpoint entries: the scale the next step uses (fp32) and the clean steps counted towards growth
        (int32), CPU scalars (reads the device)."""
        saved = self.scaler.state_dict()
        return {SCALE_KEY: torch.tensor(saved["scale"], dtype=torch.float32),
                TRACKER_KEY: torch.tensor(saved["_growth_tracker"], dtype=torch.int32)}

    def load(self, scale: float, growth_tracker: int) -> None:
        """Continue from a checkpoint's scale and growth tracker (the settings stay this run's)."""
        if not (math.isfinite(scale) and scale > 0) or growth_tracker < 0:
            raise InputError(f"checkpoint loss scale {scale} / growth tracker {growth_tracker} is not a positive "
                             "finite scale and a count")
        self.scaler.load_state_dict({**self.scaler.state_dict(), "scale": scale, "_growth_tracker": growth_tracker})


@dataclass(frozen=True)
class OverflowInjection:
    """A test's request (FLASHFLEX_OVERFLOW_INJECT) to make plan rank `rank`'s gradient inf at step `step`."""

    rank: int
    step: int

    @classmethod
    def parse(cls, text: str) -> OverflowInjection:
        """Parse "rank=R,step=K"; InputError naming the field."""
        fields = parse_injection(INJECT_ENV, text, ("rank", "step"), ("rank", "step"))
        return cls(**fields)


def injected_steps(env: Mapping[str, str], rank: int) -> frozenset[int]:
    """The steps at which FLASHFLEX_OVERFLOW_INJECT makes plan rank `rank`'s gradient inf (empty when unset)."""
    text = env.get(INJECT_ENV, "").strip()
    if not text:
        return frozenset()
    injection = OverflowInjection.parse(text)
    return frozenset({injection.step}) if injection.rank == rank else frozenset()


def poison(grads: list[torch.Tensor]) -> None:
    """Make the first element of the first non-empty gradient inf (test injection of an overflow)."""
    for grad in grads:
        if grad.numel():
            grad.view(-1)[0] = math.inf
            return

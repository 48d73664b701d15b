"""1F1B pipeline schedule (PipeDream-Flush, Narayanan et al. 2021) for one pipeline and its micro-batch count,
and the stage-boundary transfers, including boundaries where the TP degree changes (see `groups`).

Sends are non-blocking (waited at the end of the step, or with the receive they are batched with); receives
block. A send and the receive that follows it in the schedule go out as one `batch_isend_irecv`, as in
Megatron-LM's send_forward_recv_backward, so backends whose sends block until matched (NCCL) cannot deadlock.
Activations and gradients cross boundaries in fp32 [mbs, seq, hidden].
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .groups import PlanGroups
from .slowdown import Slowdown

FWD_TAG, BWD_TAG = 1, 2


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> list[tuple[str, int]]:
    """The op sequence of `stage`: ("F", i) forward of micro-batch i, ("B", i) its backward.

    Warm-up of min(num_stages - stage - 1, num_micro) forwards, then alternating forward/backward, then the
    remaining backwards.
    """
    warmup = min(num_stages - stage - 1, num_micro)
    ops: list[tuple[str, int]] = [("F", i) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while fwd < num_micro:
        ops.append(("F", fwd))
        fwd += 1
        ops.append(("B", bwd))
        bwd += 1
    ops.extend(("B", i) for i in range(bwd, num_micro))
    return ops


@dataclass
class PipelineTimes:
    """Seconds spent in one step: forward and backward compute (with emulated slowdown), point-to-point.

    With `ops` a list, each compute op is appended as (kind "F" or "B", micro-batch, start_s, end_s): seconds of
    time.perf_counter() since `origin` (the step start)."""

    forward: float = 0.0
    backward: float = 0.0
    p2p: float = 0.0
    pending: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)  # sends and their buffers
    ops: list[tuple[str, int, float, float]] | None = None
    origin: float = 0.0

    def op(self, kind: str, micro: int, start: float, end: float) -> None:
        """Note one compute op that ran from `start` to `end` (perf_counter seconds), when ops are recorded."""
        if self.ops is not None:
            self.ops.append((kind, micro, start - self.origin, end - self.origin))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PipelineRunner:
    """Runs the 1F1B schedule of one rank's stage.

    `stage_fn(x, targets)` is the stage module's forward (hidden, or the summed loss on the last stage).
    """

    def __init__(self, stage_fn: Callable[..., torch.Tensor], groups: PlanGroups, num_stages: int,
                 num_micro: int, act_shape: tuple[int, int, int], device: torch.device,
                 autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
                 slowdown: Slowdown | None = None) -> None:
        self.stage_fn, self.groups, self.device = stage_fn, groups, device
        self.first, self.last = groups.stage == 0, groups.stage == num_stages - 1
        self.ops = one_f_one_b(num_stages, groups.stage, num_micro)
        self.num_micro, self.act_shape = num_micro, act_shape
        self.autocast, self.slowdown = autocast, slowdown or Slowdown(1.0)

    def _exchange(self, send: torch.Tensor | None, dsts: tuple[int, ...], send_tag: int, src: int | None,
                  recv_tag: int, times: PipelineTimes) -> torch.Tensor | None:
        """Post the sends of `send` to `dsts` and a receive from `src` as ONE batch (NCCL pairs them, so two
        neighbours that each send before receiving cannot deadlock). A batch with a receive is waited for; lone
        sends are waited for at the end of the step. Returns the received fp32 [mbs, seq, hidden] tensor (None
        without `src`)."""
        start = time.perf_counter()
        ops: list[dist.P2POp] = []
        buf = None
        if send is not None:
            payload = send.detach().float().contiguous()
            ops += [dist.P2POp(dist.isend, payload, dst, group=self.groups.world_group, tag=send_tag)
                    for dst in dsts]
        if src is not None:
            buf = torch.empty(self.act_shape, dtype=torch.float32, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, src, group=self.groups.world_group, tag=recv_tag))
        if ops:
            works = dist.batch_isend_irecv(ops)
            if buf is not None:
                for work in works:
                    work.wait()
            else:
                times.pending += [(work, payload) for work in works]
        times.p2p += time.perf_counter() - start
        return buf

    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor | None], loss_scale: float,
            times: PipelineTimes) -> torch.Tensor:
        """Forward and backward every micro-batch; returns the summed (unscaled) loss of this pipeline's tokens
        as an fp64 scalar on the last stage (zero elsewhere). Gradients accumulate into the parameters, scaled
        by `loss_scale` (1 / global token count).

        Communication follows the schedule: a forward followed by a backward sends its activation and receives
        the backward's gradient in one batch; a backward followed by a forward sends its input gradient and
        receives the forward's activation in one batch (the neighbour's matching pair, by 1F1B symmetry).
        """
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        acts: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        g = self.groups
        for idx, (kind, i) in enumerate(self.ops):
            nxt = self.ops[idx + 1] if idx + 1 < len(self.ops) else None
            if kind == "F":
                x_in = None
                if self.first:
                    x: torch.Tensor = inputs[i]
                else:
                    if i not in acts:
                        acts[i] = self._exchange(None, (), 0, g.recv_act_from, FWD_TAG, times)  # type: ignore[assignment]
                    x_in = x = acts.pop(i).requires_grad_(True)
                start = time.perf_counter()
                with self.slowdown.op():
                    with self.autocast():
                        out = self.stage_fn(x, targets[i] if self.last else None)
                    if self.last:
                        loss_sum += out.detach().double()
                        out = out * loss_scale
                    _sync(self.device)
                end = time.perf_counter()
                times.forward += end - start
                times.op("F", i, start, end)
                if not self.last:
                    pair = nxt is not None and nxt[0] == "B"
                    got = self._exchange(out, g.send_act_to, FWD_TAG, g.recv_grad_from if pair else None,
                                         BWD_TAG, times)
                    if pair and got is not None and nxt is not None:
                        grads[nxt[1]] = got
                saved[i] = (x_in, out)
            else:
                x_in, out = saved.pop(i)
                grad = None
                if not self.last:
                    if i not in grads:
                        grads[i] = self._exchange(None, (), 0, g.recv_grad_from, BWD_TAG, times)  # type: ignore[assignment]
                    grad = grads.pop(i)
                start = time.perf_counter()
                with self.slowdown.op():
                    torch.autograd.backward(out, grad_tensors=grad)
                    _sync(self.device)
                end = time.perf_counter()
                times.backward += end - start
                times.op("B", i, start, end)
                if not self.first:
                    assert x_in is not None and x_in.grad is not None
                    pair = nxt is not None and nxt[0] == "F"
                    got = self._exchange(x_in.grad, g.send_grad_to, BWD_TAG, g.recv_act_from if pair else None,
                                         FWD_TAG, times)
                    if pair and got is not None and nxt is not None:
                        acts[nxt[1]] = got
        start = time.perf_counter()
        for work, _ in times.pending:
            work.wait()
        times.pending.clear()
        times.p2p += time.perf_counter() - start
        return loss_sum

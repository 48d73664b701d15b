"""1F1B pipeline schedule (PipeDream-Flush, Narayanan et al. 2021) for one pipeline and its micro-batch count,
and the stage-boundary transfers, including boundaries where the TP degree changes (see `groups`).

Sends are non-blocking (waited at the end of the step, or with the receive they are batched with); receives
block. A send and the receive that follows it in the schedule go out as one `batch_isend_irecv`, as in
Megatron-LM's send_forward_recv_backward, so backends whose sends block until matched (NCCL) cannot deadlock.

Activations and gradients [mbs, seq, hidden] cross a boundary in one of two ways:
- lean (RuntimeOptions.lean_p2p): in the transfer dtype (the compute dtype: bf16/fp16 under autocast on every
  device, fp32 otherwise), each sending TP rank sending only its chunks of the tensor (`semantics/boundary.ChunkPlan`) and
  the receiving TP group all-gathering them; the received tensor is cast back to fp32 for the stage;
- full (lean off): every receiving TP rank takes the whole fp32 tensor from one sending rank (`groups`).

fp16 plans send gradients multiplied by the job's loss scale (runtime/training/loss_scale.py), in fp16 on the lean path.
An element beyond fp16's range (65504) becomes inf in the cast, never a wrong finite value; every weight gradient
the receiving stage computes from it is then inf or NaN (inf times any activation, zero included), so that
rank's overflow check finds it and every rank skips the step and halves the scale. One-device training has the
same overflow: the gradient crossing a boundary is that of the receiving stage's last layer's output, which the
layer's down-projection backward casts to fp16 under autocast in any layout. (Only a receiving stage holding the
embedding and no layer keeps that gradient in fp32 on one device: there the fp16 transfer alone can overflow.)

Timing does not stall the device: compute ops and transfers are bracketed by `OpTimer` marks (CUDA events on
GPU, perf_counter on CPU) that are read once, after the step (`PipelineTimes.resolve`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...hardware.device_sync import synchronize
from ...semantics.boundary import ChunkPlan
from ...semantics.schedule import one_f_one_b
from ..device.oom import PhaseTracker
from ..device.op_timer import OpTimer
from ..device.slowdown import Slowdown
from .groups import PlanGroups

FWD_TAG, BWD_TAG = 1, 2
# all-gather into one output tensor (stacked inputs): torch >= 2.13 names it all_gather_single, earlier
# versions all_gather_into_tensor (same arguments); one copy less than a list of outputs on gloo
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class PipelineTimes:
    """Seconds spent in one step: forward and backward compute (with emulated slowdown), point-to-point
    (boundary sends and receives, with the lean path's all-gather), and `sent_bytes`, the bytes this rank put
    on boundary sends.

    With `ops` a list, each compute op is appended as (kind "F" or "B", micro-batch, start_s, end_s): seconds
    since `origin` (time.perf_counter() at the step start). forward / backward / p2p / ops are filled in by
    `resolve` once the step's OpTimer has finished (PipelineRunner.run does it when it owns the timer)."""

    forward: float = 0.0
    backward: float = 0.0
    p2p: float = 0.0
    pending: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)  # sends and their buffers
    ops: list[tuple[str, int, float, float]] | None = None
    origin: float = 0.0
    sent_bytes: int = 0
    # OpTimer marks: (kind "F", "B" or "P" for p2p, micro-batch or -1, start mark, end mark)
    spans: list[tuple[str, int, int, int]] = field(default_factory=list)
    origin_mark: int | None = None  # the mark that stands for `origin` (None: run() sets one at its start)
    origin_offset: float = 0.0  # seconds from `origin` to `origin_mark`

    def op(self, kind: str, micro: int, start: float, end: float) -> None:
        """Note one compute op that ran from `start` to `end` (perf_counter seconds), when ops are recorded."""
        if self.ops is not None:
            self.ops.append((kind, micro, start - self.origin, end - self.origin))

    def resolve(self, timer: OpTimer) -> None:
        """Add every marked span to forward / backward / p2p (and ops); call after `timer.finish()`."""
        for kind, micro, a, b in self.spans:
            seconds = timer.seconds(a, b)
            if kind == "F":
                self.forward += seconds
            elif kind == "B":
                self.backward += seconds
            else:
                self.p2p += seconds
            if kind != "P" and self.ops is not None and self.origin_mark is not None:
                self.ops.append((kind, micro, self.origin_offset + timer.seconds(self.origin_mark, a),
                                 self.origin_offset + timer.seconds(self.origin_mark, b)))
        self.spans.clear()


class PipelineRunner:
    """Runs the 1F1B schedule of one rank's stage.

    `stage_fn(x, targets)` is the stage module's forward (hidden, or the summed loss on the last stage).
    `lean`: boundary transfers split over the TP groups in `transfer_dtype` (see the module docstring); else
    every TP rank receives the full fp32 tensor.
    """

    def __init__(self, stage_fn: Callable[..., torch.Tensor], groups: PlanGroups, num_stages: int,
                 num_micro: int, act_shape: tuple[int, int, int], device: torch.device,
                 autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
                 slowdown: Slowdown | None = None, lean: bool = False,
                 transfer_dtype: torch.dtype = torch.float32, phases: PhaseTracker | None = None) -> None:
        self.stage_fn, self.groups, self.device = stage_fn, groups, device
        self.first, self.last = groups.stage == 0, groups.stage == num_stages - 1
        self.ops = one_f_one_b(num_stages, groups.stage, num_micro)
        self.num_micro, self.act_shape = num_micro, act_shape
        self.autocast, self.slowdown = autocast, slowdown or Slowdown(1.0)
        self.lean, self.transfer_dtype = lean, transfer_dtype
        self.phases = phases or PhaseTracker()  # told "forward" / "backward" as each op begins (runtime/device/oom.py)
        self.numel = act_shape[0] * act_shape[1] * act_shape[2]
        # On CUDA the device is never synchronised for timing; an emulated slowdown still needs the op's device
        # time on the host, so it alone keeps the synchronize.
        self._sync_ops = device.type == "cuda" and self.slowdown.factor > 1.0

    def _wait(self, work: dist.Work) -> None:
        """Wait for a send or receive: on gloo within the groups' current timeout (`PlanGroups.p2p_wait`), on NCCL
        as its group says (a timeout given to an NCCL wait would block the host)."""
        if self.groups.p2p_wait is not None and self.device.type == "cpu":
            work.wait(self.groups.p2p_wait)
        else:
            work.wait()

    def _sends(self, direction: str) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Where this rank's "act" (forward, downstream) or "grad" (backward, upstream) send goes: (full-path
        destinations, the whole adjacent stage for the lean path, tag)."""
        g = self.groups
        if direction == "act":
            return g.send_act_to, g.next_stage, FWD_TAG
        return g.send_grad_to, g.prev_stage, BWD_TAG

    def _recvs(self, direction: str) -> tuple[int | None, tuple[int, ...], int]:
        """Where this rank's "act" (from upstream) or "grad" (from downstream) receive comes from: (full-path
        source, the whole adjacent stage for the lean path, tag)."""
        g = self.groups
        if direction == "act":
            return g.recv_act_from, g.prev_stage, FWD_TAG
        return g.recv_grad_from, g.next_stage, BWD_TAG

    def _exchange(self, send: torch.Tensor | None, send_dir: str | None, recv_dir: str | None,
                  times: PipelineTimes, timer: OpTimer) -> torch.Tensor | None:
        """Send `send` downstream ("act") or upstream ("grad") and receive a tensor coming from the other
        direction (`recv_dir` "act": from the previous stage, "grad": from the next), as ONE batch (NCCL pairs
        them, so two neighbours that each send before receiving cannot deadlock). A batch with a receive is
        waited for; lone sends are waited for at the end of the step. Returns the received fp32
        [mbs, seq, hidden] tensor (None without a receive)."""
        start = timer.mark()
        ops: list[dist.P2POp] = []
        keep: list[torch.Tensor] = []
        world = self.groups.world_group
        if send is not None and send_dir is not None:
            dsts, stage, tag = self._sends(send_dir)
            if self.lean:
                plan = ChunkPlan(self.groups.tp_size, len(stage), self.numel)
                padded = self._padded(send, plan)
                c = plan.chunk_numel
                for k, j in plan.sent_by(self.groups.tp_rank):
                    ops.append(dist.P2POp(dist.isend, padded[k * c:(k + 1) * c], stage[j], group=world, tag=tag))
                    times.sent_bytes += c * padded.element_size()
                keep.append(padded)
            else:
                payload = send.detach().float().contiguous()
                ops += [dist.P2POp(dist.isend, payload, dst, group=world, tag=tag) for dst in dsts]
                times.sent_bytes += len(dsts) * payload.numel() * payload.element_size()
                keep.append(payload)
        mine = got = None
        recv_plan = None
        if recv_dir is not None:
            src, stage, tag = self._recvs(recv_dir)
            if self.lean:
                recv_plan = ChunkPlan(len(stage), self.groups.tp_size, self.numel)
                mine = torch.empty((recv_plan.per_receiver, recv_plan.chunk_numel), dtype=self.transfer_dtype,
                                   device=self.device)
                for m, (_, i) in enumerate(recv_plan.received_by(self.groups.tp_rank)):
                    ops.append(dist.P2POp(dist.irecv, mine[m], stage[i], group=world, tag=tag))
            else:
                assert src is not None
                got = torch.empty(self.act_shape, dtype=torch.float32, device=self.device)
                ops.append(dist.P2POp(dist.irecv, got, src, group=world, tag=tag))
        if ops:
            works = dist.batch_isend_irecv(ops)
            if recv_dir is not None:
                for work in works:
                    self._wait(work)
            else:
                times.pending += [(work, keep[0]) for work in works]
        if mine is not None and recv_plan is not None:
            got = self._assemble(mine, recv_plan)
        times.spans.append(("P", -1, start, timer.mark()))
        return got

    def _padded(self, send: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
        """`send` flattened in the transfer dtype, zero-padded to n * c elements (a view where no cast or
        padding is needed)."""
        flat = send.detach().to(self.transfer_dtype).reshape(-1)
        total = plan.chunks * plan.chunk_numel
        if total == self.numel:
            return flat.contiguous()
        padded = flat.new_zeros(total)
        padded[:self.numel] = flat
        return padded

    def _assemble(self, mine: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
        """The full fp32 [mbs, seq, hidden] tensor from this rank's received chunks `mine` [n / t', c]: all-gather
        them over the TP group (receiver j's slot m holds chunk j + m t'), put the chunks in order, unpad."""
        if plan.receivers == 1:
            flat = mine.reshape(-1)
        else:
            gathered = torch.empty((plan.receivers, *mine.shape), dtype=mine.dtype, device=mine.device)
            _gather_into(gathered.view(-1), mine.view(-1), group=self.groups.tp_group)
            flat = gathered.transpose(0, 1).reshape(-1)
        full = flat[:self.numel].view(self.act_shape)
        return full.to(torch.float32)  # the stage's input dtype; a no-op in fp32

    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor | None], loss_scale: float,
            times: PipelineTimes, timer: OpTimer | None = None,
            scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Forward and backward every micro-batch; returns the summed (unscaled) loss of this pipeline's tokens
        as an fp64 scalar on the last stage (zero elsewhere). Gradients accumulate into the parameters, scaled
        by `loss_scale` (1 / global token count) and then, with `scale_loss` (fp16: the job's dynamic loss scale,
        runtime/training/loss_scale.py), by what it multiplies the last stage's loss by; the gradients crossing stage
        boundaries carry the same factor.

        Communication follows the schedule: a forward followed by a backward sends its activation and receives
        the backward's gradient in one batch; a backward followed by a forward sends its input gradient and
        receives the forward's activation in one batch (the neighbour's matching pair, by 1F1B symmetry).

        Timing: ops and transfers are marked on `timer`. Without one, run() makes its own, finishes it at the
        end (on CUDA the one synchronize of the pipeline) and resolves `times`. With one (the caller's step
        timer), the caller calls `timer.finish()` and then `times.resolve(timer)` when it reads its own marks.
        """
        own = timer is None
        if timer is None:
            timer = OpTimer(self.device)
        if times.origin_mark is None:
            times.origin_mark = timer.mark()
            times.origin_offset = time.perf_counter() - times.origin if times.origin else 0.0
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        acts: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for idx, (kind, i) in enumerate(self.ops):
            nxt = self.ops[idx + 1] if idx + 1 < len(self.ops) else None
            self.phases.enter("forward" if kind == "F" else "backward")
            if kind == "F":
                x_in = None
                if self.first:
                    x: torch.Tensor = inputs[i]
                else:
                    if i not in acts:
                        acts[i] = self._exchange(None, None, "act", times, timer)  # type: ignore[assignment]
                    x_in = x = acts.pop(i).requires_grad_(True)
                start = timer.mark()
                with self.slowdown.op():
                    with self.autocast():
                        out = self.stage_fn(x, targets[i] if self.last else None)
                    if self.last:
                        loss_sum += out.detach().double()
                        out = out * loss_scale
                        if scale_loss is not None:
                            out = scale_loss(out)
                    if self._sync_ops:
                        synchronize(self.device)
                times.spans.append(("F", i, start, timer.mark()))
                if not self.last:
                    pair = nxt is not None and nxt[0] == "B"
                    got = self._exchange(out, "act", "grad" if pair else None, times, timer)
                    if pair and got is not None and nxt is not None:
                        grads[nxt[1]] = got
                saved[i] = (x_in, out)
            else:
                x_in, out = saved.pop(i)
                grad = None
                if not self.last:
                    if i not in grads:
                        grads[i] = self._exchange(None, None, "grad", times, timer)  # type: ignore[assignment]
                    grad = grads.pop(i)
                start = timer.mark()
                with self.slowdown.op():
                    torch.autograd.backward(out, grad_tensors=grad)
                    if self._sync_ops:
                        synchronize(self.device)
                times.spans.append(("B", i, start, timer.mark()))
                if not self.first:
                    assert x_in is not None and x_in.grad is not None
                    pair = nxt is not None and nxt[0] == "F"
                    got = self._exchange(x_in.grad, "grad", "act" if pair else None, times, timer)
                    if pair and got is not None and nxt is not None:
                        acts[nxt[1]] = got
        start = timer.mark()
        for work, _ in times.pending:
            self._wait(work)
        times.pending.clear()
        times.spans.append(("P", -1, start, timer.mark()))
        if own:
            timer.finish()
            times.resolve(timer)
        return loss_sum

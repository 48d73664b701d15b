"""1F1B pipeline schedule, simulated as events over dependencies (PipeDream-Flush / Megatron 1F1B,
Narayanan et al. 2021).

Stage s of S runs, in this order: a warm-up of w = min(S - s - 1, m) forwards, then m - w pairs of
(one forward, one backward), then a cool-down of the w remaining backwards. Forward i on stage s waits
for forward i on stage s - 1 plus the transfer between them; backward i on stage s waits for backward i
on stage s + 1 plus the transfer back. A stage runs one operation at a time; transfers do not occupy
the stages (asynchronous sends). For uniform stages and free transfers the result equals the closed form
(m + S - 1) (f + b).

The closed form (`closed_form_s`, the planner's fast path) charges a pipeline of m micro-batches
fill + (m - 1) x period: `fill_s` one micro-batch through every stage and back, `steady_period_s` the 1F1B
period with transfer latency (the slowest window of stages); `drain_offsets_s` places each stage's last
backward in the cool-down. The time equals the simulation for uniform stages and free transfers, the
cool-down wherever no stage's backward is longer than the next one's, and the period follows the simulation's
within 2% (tests/test_cost_schedule.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..semantics.schedule import FORWARD, one_f_one_b


@dataclass(frozen=True)
class ScheduleResult:
    """Outcome of one pipeline's 1F1B schedule (seconds).

    total_s: from the first forward to the last operation. bubble_fraction: idle share of the stages,
    1 - sum(busy_s) / (S * total_s). busy_s[s]: compute time of stage s. last_backward_end_s[s]: when
    stage s finishes its last backward (its gradients are then final and DP reduction may start).
    """

    total_s: float
    bubble_fraction: float
    busy_s: tuple[float, ...]
    last_backward_end_s: tuple[float, ...]


def stage_order(stage: int, num_stages: int, num_micro_batches: int) -> list[tuple[bool, int]]:
    """The 1F1B operation order of one stage, the runtime's (`semantics.schedule.one_f_one_b`): (is_forward,
    micro-batch index) pairs."""
    return [(op == FORWARD, i) for op, i in one_f_one_b(num_stages, stage, num_micro_batches)]


def simulate_1f1b(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float],
                  num_micro_batches: int, p2p_back_s: Sequence[float] | None = None) -> ScheduleResult:
    """Simulate one pipeline: fwd_s[s], bwd_s[s] per micro-batch on stage s; p2p_s[s] the activation
    transfer from s to s + 1; p2p_back_s[s] the gradient transfer from s + 1 back to s (default p2p_s)."""
    back = p2p_s if p2p_back_s is None else p2p_back_s
    if len(fwd_s) != len(bwd_s) or len(p2p_s) != max(len(fwd_s) - 1, 0) or len(back) != len(p2p_s):
        raise ValueError(f"need S forward and backward times and S-1 transfers, got {len(fwd_s)}, "
                         f"{len(bwd_s)}, {len(p2p_s)}, {len(back)}")
    if num_micro_batches < 1 or not fwd_s:
        raise ValueError("need at least one stage and one micro-batch")
    return _simulate(tuple(map(float, fwd_s)), tuple(map(float, bwd_s)), tuple(map(float, p2p_s)),
                     tuple(map(float, back)), int(num_micro_batches))


@lru_cache(maxsize=8192)
def _simulate(fwd: tuple[float, ...], bwd: tuple[float, ...], p2p: tuple[float, ...], back: tuple[float, ...],
              m: int) -> ScheduleResult:
    """The event simulation, operation by operation in an order that has every operation after the ones it waits
    for: by position k in the stage's `stage_order` (a wave). Stage s (warm-up w = min(S - s - 1, m)) runs at k the
    forward k while k < w, after the stage before's forward k of the same wave (ascending stages); then alternately
    forward (k + w) / 2 and backward (k - w - 1) / 2, after the neighbour's operation of the wave before (the
    stage before's forward, the stage after's backward, the last stage's own forward), or, for a stage's first
    forward after its warm-up, the stage before's last warm-up forward of the same wave; then from k = 2m - w the
    backward k - m, after the stage after's backward of the same wave (descending stages). Each stage's last
    operation is its last backward."""
    stages = len(fwd)
    top = stages - 1
    step_in = (0.0, *p2p)  # a forward waits for the stage before's plus the transfer (stage 0: for nothing)
    step_back = (*back, 0.0)  # a backward for the stage after's plus the transfer back (the last stage: its own)
    clock = [0.0] * stages  # when each stage's last operation so far ended
    for k in range(2 * m):
        warm = top - k if k < m else 0  # stages 0..warm-1 run a warm-up forward
        cool = stages - 2 * m + k if k >= m else 0  # stages 0..cool-1 run a cool-down backward
        low = max(0, warm, cool)  # stages low..top alternate: forward where k - w is even, w = top - s
        before = clock[:]  # each stage's operation of the wave before
        for s in range(warm):
            ready = (clock[s - 1] if s else 0.0) + step_in[s]
            now = clock[s]
            if ready > now:
                now = ready
            clock[s] = now + fwd[s]
        for s in range(low + ((k + top - low) & 1), stages, 2):
            ready = (0.0 if s == 0 else clock[s - 1] if s == warm else before[s - 1]) + step_in[s]
            now = before[s]
            if ready > now:
                now = ready
            clock[s] = now + fwd[s]
        for s in range(top - ((k + 1) & 1), low - 1, -2):
            ready = (before[s + 1] if s < top else before[s]) + step_back[s]
            now = before[s]
            if ready > now:
                now = ready
            clock[s] = now + bwd[s]
        for s in range(cool - 1, -1, -1):
            ready = clock[s + 1] + step_back[s]
            now = clock[s]
            if ready > now:
                now = ready
            clock[s] = now + bwd[s]
    total = max(clock)
    busy = tuple(m * (fwd[s] + bwd[s]) for s in range(stages))
    span = stages * total
    idle = span - sum(busy)
    bubble = idle / span if span > 0 and idle > 1e-12 * span else 0.0  # none: rounding of a sum, not idle time
    return ScheduleResult(total, bubble, busy, tuple(clock))


def stage_pass_s(num_layers: int, layer_s: float, embed_s: float, head_s: float, first: bool, last: bool) -> float:
    """Seconds of one pass (forward or backward) of one micro-batch through a stage of `num_layers` layers of
    `layer_s` each, with the embedding's `embed_s` on the first stage and the head's `head_s` on the last."""
    return num_layers * layer_s + (embed_s if first else 0.0) + (head_s if last else 0.0)


def fill_s(times_s: Sequence[float], links_s: Sequence[float]) -> float:
    """Seconds for one micro-batch through every stage and back: times_s[s] its forward + backward on stage s,
    a forward and a backward transfer of links_s[s] per hop."""
    return sum(times_s) + 2 * sum(links_s)


@lru_cache(maxsize=256)
def _windows(count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every window s <= t of `count` stages: s, t, t + 1 and its width t - s + 1 (float)."""
    s_idx, t_idx = np.triu_indices(count)
    return s_idx, t_idx, t_idx + 1, (t_idx - s_idx + 1).astype(np.float64)


def steady_period_s(times_s: Sequence[float], links_s: Sequence[float]) -> float:
    """Steady-state 1F1B period (seconds per micro-batch) with transfer latency, in closed form.

    Stage s runs F(i + w_s), B(i), F(i + w_s + 1), ... with w_s = S - s - 1. For any window of stages s..t, a
    micro-batch's forward entering s and its backward leaving s close a cycle through every stage and link of
    the window that spans t - s + 1 periods, so the period is at least
    (sum_{j=s..t} u_j + 2 sum_{j=s..t-1} p2p_j) / (t - s + 1), u_j = times_s[j] (forward + backward). The
    maximum over all windows is the period; with free transfers (or one stage), the slowest stage.
    """
    count = len(times_s)
    if count == 1 or not 2 * sum(links_s) > 0:
        return max(times_s)
    big_u = np.zeros(count + 1)
    big_c = np.zeros(count + 1)
    np.add.accumulate(times_s, out=big_u[1:])  # np.cumsum's sequential sums
    np.add.accumulate(links_s, out=big_c[1:count])
    # cost of window s..t = U[t+1] - U[s] + 2 (C[t] - C[s]) where C counts links s..t-1
    s_idx, t_idx, t_next, width = _windows(count)
    cost = big_u[t_next] - big_u[s_idx] + 2.0 * (big_c[t_idx] - big_c[s_idx])
    return float((cost / width).max())


def pair_window_s(first_s: float, second_s: float, link_s: float) -> float:
    """The window of two adjacent stages of forward + backward `first_s` and `second_s` joined by a link of
    `link_s` (see `steady_period_s`): a lower bound on the period (seconds per micro-batch)."""
    return (first_s + second_s + 2.0 * link_s) / 2.0


def period_exceeds(times_s: Sequence[float], links_s: Sequence[float], period_s: float) -> bool:
    """Whether `steady_period_s(times_s, links_s)` exceeds `period_s` seconds, in O(S): whether some window of
    stages s..t costs more than t - s + 1 periods, i.e. whether the largest sum over a run of stages of
    (times_s[j] - period_s), plus twice the links inside the run, is positive (Kadane's maximum-sum run: the best
    run ending at stage j either extends the best one ending at j - 1 over their link or starts at j)."""
    run = times_s[0] - period_s
    if run > 0.0:
        return True
    for time_s, link_s in zip(times_s[1:], links_s, strict=True):
        extended = run + 2.0 * link_s
        run = (extended if extended > 0.0 else 0.0) + time_s - period_s
        if run > 0.0:
            return True
    return False


def closed_form_s(period_s: float, fill_s: float, num_micro_batches: int) -> float:
    """Seconds for `num_micro_batches` micro-batches through one pipeline of that period and fill."""
    return fill_s + (num_micro_batches - 1) * period_s


def drain_offsets_s(bwd_s: Sequence[float], p2p_back_s: Sequence[float]) -> list[float]:
    """When each stage's last backward ends, in seconds relative to stage 0's (the pipeline's last operation,
    so every offset is <= 0), in closed form: in the cool-down, stage s - 1 runs its last backward as soon as
    stage s's gradient arrives, so stage s ends bwd_s[s - 1] + p2p_back_s[s - 1] before stage s - 1. bwd_s[s]:
    stage s's backward of one micro-batch. Exact where no stage's backward is longer than the next stage's
    (equal stages among them): the stage before is then idle when the gradient arrives."""
    out = [0.0]
    end = 0.0
    for whole, back in zip(bwd_s[:-1], p2p_back_s, strict=True):
        end -= whole + back
        out.append(end)
    return out

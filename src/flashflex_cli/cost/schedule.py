"""1F1B pipeline schedule, simulated as events over dependencies (PipeDream-Flush / Megatron 1F1B,
Narayanan et al. 2021).

Stage s of S runs, in this order: a warm-up of w = min(S - s - 1, m) forwards, then m - w pairs of
(one forward, one backward), then a cool-down of the w remaining backwards. Forward i on stage s waits
for forward i on stage s - 1 plus the transfer between them; backward i on stage s waits for backward i
on stage s + 1 plus the transfer back. A stage runs one operation at a time; transfers do not occupy
the stages (asynchronous sends). For uniform stages and free transfers the result equals the closed form
(m + S - 1) (f + b).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import chain, repeat


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
    """The 1F1B operation order of one stage: (is_forward, micro-batch index) pairs."""
    m = num_micro_batches
    warmup = min(num_stages - stage - 1, m)
    steady = m - warmup
    order = list(zip(repeat(True, warmup), range(warmup), strict=True))
    # steady state: forward warmup + i, then backward i
    forwards = zip(repeat(True, steady), range(warmup, m), strict=True)
    order.extend(chain.from_iterable(zip(forwards, zip(repeat(False, steady), range(steady), strict=True),
                                         strict=True)))
    order.extend(zip(repeat(False, warmup), range(steady, m), strict=True))
    return order


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


@lru_cache(maxsize=256)
def _orders(stages: int, m: int) -> tuple[tuple[tuple[bool, int], ...], ...]:
    """`stage_order` of every stage of a pipeline of `stages` stages and `m` micro-batches (shared, read-only)."""
    return tuple(tuple(stage_order(s, stages, m)) for s in range(stages))


@lru_cache(maxsize=8192)
def _simulate(fwd: tuple[float, ...], bwd: tuple[float, ...], p2p: tuple[float, ...], back: tuple[float, ...],
              m: int) -> ScheduleResult:
    stages = len(fwd)
    orders = _orders(stages, m)
    f_end: list[list[float | None]] = [[None] * m for _ in range(stages)]
    b_end: list[list[float | None]] = [[None] * m for _ in range(stages)]
    clock = [0.0] * stages
    pos = [0] * stages
    remaining = stages * 2 * m
    last = stages - 1
    while remaining:
        progressed = False
        for s in range(stages):
            # run stage s's operations in order until one waits for a neighbour (locals: the hot loop)
            order, f_row, b_row = orders[s], f_end[s], b_end[s]
            upstream_row = f_end[s - 1] if s else f_row
            downstream_row = b_end[s + 1] if s < last else b_row
            step_in, step_back = (p2p[s - 1] if s else 0.0), (back[s] if s < last else 0.0)
            f_s, b_s = fwd[s], bwd[s]
            at, count, now = pos[s], len(order), clock[s]
            start = at
            while at < count:
                forward, i = order[at]
                if forward:
                    if s == 0:
                        ready = 0.0
                    else:
                        upstream = upstream_row[i]
                        if upstream is None:
                            break
                        ready = upstream + step_in
                    now = max(now, ready) + f_s
                    f_row[i] = now
                else:
                    if s == last:
                        ready = f_row[i]  # type: ignore[assignment]
                    else:
                        downstream = downstream_row[i]
                        if downstream is None:
                            break
                        ready = downstream + step_back
                    now = max(now, ready) + b_s
                    b_row[i] = now
                at += 1
            if at != start:
                pos[s], clock[s] = at, now
                remaining -= at - start
                progressed = True
        if not progressed:  # cannot happen for a valid 1F1B order; guard against an endless loop
            raise RuntimeError("1F1B simulation made no progress")
    total = max(clock)
    busy = tuple(m * (fwd[s] + bwd[s]) for s in range(stages))
    bubble = 1.0 - sum(busy) / (stages * total) if total > 0 else 0.0
    last_b = tuple(float(b_end[s][m - 1]) for s in range(stages))  # type: ignore[arg-type]
    return ScheduleResult(total, bubble, busy, last_b)

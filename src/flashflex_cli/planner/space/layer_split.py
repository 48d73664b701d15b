"""Exact min-max split of L transformer layers over the ordered stages of one pipeline.

Stage s holds n_s >= 1 contiguous layers and takes n_s * t_s + e_s seconds per micro-batch (t_s: one
layer's forward + backward on its TP group; e_s: embedding / head work on the first / last stage), and
can hold at most c_s layers in memory. We minimise the slowest stage, max_s (n_s * t_s + e_s), which sets
the pipeline's steady-state pace under 1F1B (FlashFlex, arXiv 2409.01143, sec. 4: layers in proportion
to speed, not to memory as the prototype did).

Because the stage order is fixed and layers are contiguous, a split is determined by its counts alone,
so a time T is reachable iff every cap_s(T) = min(c_s, floor((T - e_s) / t_s)) >= 1 and
sum_s cap_s(T) >= L. The optimum is one of the values n * t_s + e_s; starting from a lower bound (the
continuous relaxation) we step through those breakpoints in increasing order until T is reachable,
which finds the smallest reachable one exactly (each step adds at least one layer of room, so at most
L steps, each O(K log S) over the K kinds of stage). Among the optimal splits we take
the one with the least total work sum n_s * t_s (layers go to the fastest stages first), which
shortens the pipeline's fill and drain. (tests/test_planner_splits.py checks it against the textbook
O(S L^2) dynamic programme.)
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from typing import Literal

_EPS = 1e-12


def _room(t: float, e: float, limit: float) -> int:
    """Most layers a stage of per-layer time t and fixed time e runs within `limit` seconds."""
    return int(math.floor((limit - e) / t * (1 + _EPS) + 1e-9))


def split_layers(
    per_layer_s: Sequence[float], extra_s: Sequence[float], max_layers: Sequence[int], num_layers: int
) -> list[int] | None:
    """Layer counts per stage minimising the slowest stage; None when no split fits.

    per_layer_s[s]: seconds per layer per micro-batch on stage s (> 0); extra_s[s]: fixed seconds on
    stage s; max_layers[s]: memory cap of stage s in layers.
    """
    split = split_layers_within(per_layer_s, extra_s, max_layers, num_layers, math.inf)
    assert split is not False
    return split


def split_layers_within(
    per_layer_s: Sequence[float], extra_s: Sequence[float], max_layers: Sequence[int], num_layers: int,
    pace_s: float
) -> list[int] | None | Literal[False]:
    """`split_layers`, or False as soon as the walk shows that every split has a stage slower than `pace_s`
    seconds (a caller that only wants splits within a pace stops there: at most the walk's cost, often only its
    set-up). None when no split fits in memory, as `split_layers` (checked first)."""
    t, e = per_layer_s, extra_s
    stages = len(t)
    if stages == 0 or stages > num_layers:
        return None
    c = [m if m < num_layers else num_layers for m in max_layers]
    if min(c) < 1 or sum(c) < num_layers:
        return None
    # Stages of one kind (equal t and e: the same TP degree on the same device type) have the same room at
    # every limit but their caps, so the walk runs over kinds (the planner's hottest loop): a kind's caps sorted,
    # with prefix sums, give its room at a limit by one bisection.
    caps_by_kind: dict[tuple[float, float], list[int]] = {}
    for key, cap in zip(zip(t, e, strict=True), c, strict=True):
        found = caps_by_kind.get(key)
        if found is None:
            caps_by_kind[key] = [cap]
        else:
            found.append(cap)
    # Start at a lower bound: every stage holds a layer, and the continuous relaxation
    # sum_s (T - e_s) / t_s = L; then walk up the breakpoints n * t_s + e_s in increasing order.
    inverse, shift, slowest = 0.0, 0.0, 0.0
    kinds = []
    for (ts, es), caps in caps_by_kind.items():
        count = len(caps)
        inverse += count / ts
        shift += count * es / ts
        if ts + es > slowest:
            slowest = ts + es
        caps.sort()
        prefix = [0]
        for cap in caps:
            prefix.append(prefix[-1] + cap)
        kinds.append((ts, es, caps, prefix, count))
    limit = max(slowest, (num_layers + shift) / inverse)
    if limit > pace_s:  # every stage holds a layer, and the relaxation is a lower bound on the slowest stage
        return False
    # _room inlined: every kind's room at `limit`, then at the next breakpoint (`step`) until the rooms hold the
    # layers. A kind whose every stage is at its cap keeps that room at every larger limit, so it leaves the loop
    # (`active`: the others; `full`: the room of the kinds at their caps).
    floor, scale = math.floor, 1 + _EPS
    active, full = kinds, 0
    while True:
        room, step, still = full, math.inf, []
        for kind in active:
            ts, es, caps, prefix, count = kind
            n = floor((limit - es) / ts * scale + 1e-9)
            below = bisect_right(caps, n)  # stages whose cap is at most n
            if below < count:
                room += prefix[below] + n * (count - below)
                still.append(kind)
                nxt = (n + 1) * ts + es
                if nxt < step:
                    step = nxt
            else:
                room += prefix[count]
                full += prefix[count]
        active = still
        if room >= num_layers:
            break
        if step > pace_s:  # no room changes up to the next breakpoint: the optimum is past the pace
            return False
        limit = step
    counts = [1] * stages
    left = num_layers - stages
    for s in sorted(range(stages), key=t.__getitem__):  # stable: ties in stage order
        n = floor((limit - e[s]) / t[s] * scale + 1e-9)
        take = (c[s] if c[s] < n else n) - 1
        if take > left:
            take = left
        counts[s] += take
        left -= take
        if left == 0:
            break
    return counts


def stage_times(per_layer_s: Sequence[float], extra_s: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Seconds per micro-batch of every stage for a given split."""
    return [n * t + e for t, e, n in zip(per_layer_s, extra_s, counts, strict=True)]

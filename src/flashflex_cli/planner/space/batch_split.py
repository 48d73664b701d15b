"""Split the global batch's micro-batches over pipelines in proportion to their throughput.

Pipeline p with m micro-batches takes about fill_p + (m - 1) * pace_p seconds under 1F1B (the cost model's
closed form, `cost.schedule.closed_form_s`: pace, its steady period per micro-batch; fill, one micro-batch
through every stage and back, transfers included; for equal stages the textbook (m + S - 1) * (f + b)). We minimise the slowest pipeline subject to
sum m_p = M and m_p >= S_p (1F1B needs a micro-batch per stage): start every pipeline at S_p and give
each further micro-batch to the pipeline that finishes it soonest. Each pipeline's time is increasing in
m, so this greedy is exact for the min-max (an exchange argument). The prototype split batches uniformly.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ...errors import InfeasibleError


def micro_batches(global_batch: int, micro_batch_size: int) -> int:
    """Micro-batches per step; a global batch that micro-batches do not divide is infeasible."""
    if global_batch % micro_batch_size:
        raise InfeasibleError(
            f"global batch {global_batch} is not a multiple of micro-batch size {micro_batch_size}; "
            f"use a global batch of {global_batch // micro_batch_size * micro_batch_size} or "
            f"{(global_batch // micro_batch_size + 1) * micro_batch_size}"
        )
    return global_batch // micro_batch_size


def split_batch(total: int, pace_s: Sequence[float], fill_s: Sequence[float],
                min_counts: Sequence[int]) -> list[int] | None:
    """Micro-batches per pipeline minimising the slowest pipeline; None if `total` < sum(min_counts).

    Pipeline p with m micro-batches takes fill_s[p] + m * pace_s[p] seconds here (so pass the
    pipeline's fill minus one pace).
    """
    counts = [int(m) for m in min_counts]
    left = total - sum(counts)
    if left < 0:
        return None
    # Jump-start: at the continuous optimum's time T (a lower bound on the optimum), pipeline p fits
    # floor((T - fill_p) / pace_p) micro-batches beyond the first; no optimal split gives it fewer, so the
    # greedy below continues from there to the same optimum, with at most one step per pipeline.
    if left > len(counts) and all(pace > 0 for pace in pace_s):
        inverse = sum(1.0 / pace for pace in pace_s)
        limit = (total + sum(fill / pace for fill, pace in zip(fill_s, pace_s, strict=True))) / inverse
        start = [max(m, int((limit - fill) / pace)) for m, fill, pace in zip(counts, fill_s, pace_s, strict=True)]
        if sum(start) <= total:
            counts = start
            left = total - sum(counts)
    heap = [(fill_s[p] + (counts[p] + 1) * pace_s[p], p) for p in range(len(counts))]
    heapq.heapify(heap)
    for _ in range(left):
        _, p = heapq.heappop(heap)
        counts[p] += 1
        heapq.heappush(heap, (fill_s[p] + (counts[p] + 1) * pace_s[p], p))
    return counts

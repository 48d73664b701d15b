"""Micro-batch size searched per pipeline, together with the pipeline's micro-batch count.

A pipeline that runs micro-batches of b sequences pays, per micro-batch, the cost model's per-micro-batch
times at b (compute a + b * slope per layer, transfers of [b, s, h] activations), and keeps b sequences'
activations per micro-batch in flight (memory grows with b, so the exact layer split under memory is
redone at b: `pipeline_score.evaluate_pipeline` on a `CostCache` whose training configuration has
micro_batch_size b). Larger b amortises the fixed part of every layer, transfer latencies and the TP
all-reduces' latency; smaller b gives more micro-batches, so a smaller fill/drain bubble.

Options: b = base x 2^j <= `max_mbs` that divide the global batch (base: the configuration's micro-batch
size). Because every option is a power-of-two multiple of the smallest and divides the global batch, the
sequences left to hand out are always a multiple of the smallest chosen b, so the greedy below always ends
on the exact global batch.

For a fixed choice of b per pipeline, `split_sequences` hands out micro-batches (b_p sequences each) to
the pipeline that would finish its next one soonest, as `batch_split.split_batch` does, starting from the
continuous optimum. The b of each pipeline is chosen by coordinate descent over groups of pipelines of
equal shape (they cost the same, so they take the same b): every group tries every option, a change is
kept when the candidate's fast score (pipelines and data-parallel reduction, `dp_score.dp_finish`)
falls, until a round changes nothing (at most `ROUNDS` rounds). The finalists are then ranked by
`cost.estimate.estimate` alone, as for every plan.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from ...cost.schedule import closed_form_s
from ..scoring.candidate import Candidate
from ..scoring.cost_cache import CostCache
from ..scoring.dp_score import dp_finish
from ..scoring.pipeline_score import PipeEval, evaluate_pipeline

ROUNDS = 3


def mbs_options(global_batch: int, base: int, max_mbs: int) -> list[int]:
    """Micro-batch sizes to try (ascending): base x 2^j <= max_mbs dividing `global_batch` (sequences)."""
    out, b = [], base
    while b <= max(max_mbs, base):
        if global_batch % b == 0:
            out.append(b)
        b *= 2
    return out


def split_sequences(total: int, sizes: Sequence[int], pace_s: Sequence[float], fill_s: Sequence[float],
                    min_counts: Sequence[int]) -> list[int] | None:
    """Micro-batches per pipeline (pipeline p: `sizes[p]` sequences each) covering exactly `total` sequences
    with the slowest pipeline as early as the greedy finds; None when the minimum counts exceed `total`.

    Pipeline p with m micro-batches takes fill_s[p] + m * pace_s[p] seconds (pass fill minus one pace).
    """
    counts = [int(m) for m in min_counts]
    left = total - sum(c * b for c, b in zip(counts, sizes, strict=True))
    if left < 0:
        return None
    rate = sum(b / pace for b, pace in zip(sizes, pace_s, strict=True)) if all(p > 0 for p in pace_s) else 0.0
    if left > sum(sizes) and rate > 0:
        # continuous optimum T: sum_p b_p (T - fill_p) / pace_p = total; nobody gets fewer than floor there
        limit = (total + sum(b * f / p for b, f, p in zip(sizes, fill_s, pace_s, strict=True))) / rate
        start = [max(m, int((limit - f) / p)) for m, f, p in zip(counts, fill_s, pace_s, strict=True)]
        used = sum(c * b for c, b in zip(start, sizes, strict=True))
        if used <= total:
            counts, left = start, total - used
    heap = [(fill_s[p] + (counts[p] + 1) * pace_s[p], p) for p in range(len(counts))]
    heapq.heapify(heap)
    while left > 0 and heap:
        _, p = heapq.heappop(heap)
        if sizes[p] > left:
            continue  # `left` only shrinks: this pipeline cannot take a whole micro-batch any more
        counts[p] += 1
        left -= sizes[p]
        heapq.heappush(heap, (fill_s[p] + (counts[p] + 1) * pace_s[p], p))
    return counts if left == 0 else None


def _score(cache: CostCache, pipes: tuple[PipeEval, ...], sizes: tuple[int, ...], total_sequences: int,
           bound: float = float("inf"), caches: Sequence[CostCache] | None = None
           ) -> tuple[float, tuple[int, ...]] | None:
    """(fast score in seconds, micro-batch counts); None when the split fails or the slowest pipeline alone
    reaches `bound` seconds."""
    micro = split_sequences(total_sequences, sizes, [p.pace_s for p in pipes], [p.fill_s - p.pace_s for p in pipes],
                            [p.num_stages for p in pipes])
    if micro is None:
        return None
    ends = [closed_form_s(p.pace_s, p.fill_s, m) for p, m in zip(pipes, micro, strict=True)]
    if max(ends) >= bound:
        return None
    return dp_finish(cache, pipes, ends, caches), tuple(micro)


class MicroBatchSearch:
    """Chooses micro-batch sizes for candidates of one search (one `CostCache` per size, sharing the graph)."""

    def __init__(self, cache: CostCache, max_mbs: int) -> None:
        train = cache.train
        self.base = cache
        self.total = train.global_batch
        self.options = mbs_options(train.global_batch, cache.micro_batch, max_mbs)
        self.caches = {b: cache if b == cache.micro_batch else CostCache(cache.graph, cache.model, train, cache.params, b,
                                                                       cache.optimizer_shard_ways)
                       for b in self.options}

    def tune(self, cand: Candidate) -> Candidate | None:
        """`cand`'s layout with the micro-batch size of every pipeline chosen (module docstring); None when
        it keeps the base size everywhere (nothing to add)."""
        if len(self.options) < 2:
            return None
        base_b = self.base.micro_batch
        count = len(cand.pipes)
        # pipelines of equal shape (same stage keys and counts at the base size) take the same size
        shape_of = [tuple(self.base.stage_key(st) for st in pipe.stages) for pipe in cand.pipes]
        groups: dict[tuple, list[int]] = {}
        for p, shape in enumerate(shape_of):
            groups.setdefault(shape, []).append(p)
        evals: dict[tuple[int, int], PipeEval] = {}

        def pipe_at(p: int, b: int) -> PipeEval:
            key = (p, b)
            if key not in evals:
                evals[key] = cand.pipes[p] if b == base_b else evaluate_pipeline(self.caches[b], cand.pipes[p].stages)
            return evals[key]

        sizes = [base_b] * count
        found = _score(self.base, cand.pipes, tuple(sizes), self.total)
        if found is None:
            return None
        best, micro = found
        for _ in range(ROUNDS):
            changed = False
            for members in groups.values():
                for b in self.options:
                    if b == sizes[members[0]] or not all(pipe_at(p, b).ok for p in members):
                        continue
                    trial = list(sizes)
                    for p in members:
                        trial[p] = b
                    pipes = tuple(pipe_at(p, trial[p]) for p in range(count))
                    got = _score(self.base, pipes, tuple(trial), self.total, best * (1 - 1e-9),
                                 [self.caches[b] for b in trial])
                    if got is not None and got[0] < best * (1 - 1e-9):
                        best, micro, sizes, changed = got[0], got[1], trial, True
            if not changed:
                break
        if all(b == base_b for b in sizes):
            return None
        pipes = tuple(pipe_at(p, sizes[p]) for p in range(count))
        return Candidate(pipes, micro, best, tuple(sizes))

"""Layer split (exact min-max), batch split (exact min-max) and the 1F1B pace formula."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

import pytest

from flashflex_cli.cost.schedule import closed_form_s as pipeline_time
from flashflex_cli.cost.schedule import simulate_1f1b
from flashflex_cli.cost.schedule import steady_period_s as window_pace
from flashflex_cli.errors import InfeasibleError
from flashflex_cli.planner.space.batch_split import micro_batches, split_batch
from flashflex_cli.planner.space.layer_split import split_layers, stage_times


def split_layers_dp(
    per_layer_s: Sequence[float], extra_s: Sequence[float], max_layers: Sequence[int], num_layers: int
) -> float:
    """The textbook O(S L^2) dynamic programme: the optimal slowest-stage time (inf when infeasible)."""
    stages = len(per_layer_s)
    best = [math.inf] * (num_layers + 1)  # best[j]: stages so far covering the first j layers
    best[0] = 0.0
    for s in range(stages):
        nxt = [math.inf] * (num_layers + 1)
        for j in range(num_layers + 1):
            if best[j] == math.inf:
                continue
            for n in range(1, min(max_layers[s], num_layers - j) + 1):
                cost = max(best[j], n * per_layer_s[s] + extra_s[s])
                if cost < nxt[j + n]:
                    nxt[j + n] = cost
        best = nxt
    return best[num_layers]



def _random_stage_terms(rng: random.Random, max_stages: int, max_layers: int
                        ) -> tuple[int, list[float], list[float], list[int]]:
    """Random inputs of a layer split: (layers, per-layer seconds, extra seconds, layer cap) of 1..max_stages
    stages, at least one layer each."""
    stages = rng.randint(1, max_stages)
    layers = rng.randint(stages, max_layers)
    t = [rng.uniform(0.01, 3.0) for _ in range(stages)]
    e = [rng.choice([0.0, 0.0, rng.uniform(0, 2)]) for _ in range(stages)]
    caps = [rng.randint(1, layers) for _ in range(stages)]
    return layers, t, e, caps


def test_layer_split_matches_the_reference_dynamic_programme() -> None:
    rng = random.Random(7)
    for _ in range(1500):
        layers, t, e, caps = _random_stage_terms(rng, 7, 36)
        got = split_layers(t, e, caps, layers)
        best = split_layers_dp(t, e, caps, layers)
        if got is None:
            assert best == math.inf
            continue
        assert sum(got) == layers
        assert all(1 <= n <= c for n, c in zip(got, caps, strict=True))
        assert max(stage_times(t, e, got)) == pytest.approx(best, rel=1e-12)


def test_layer_split_follows_speed_not_memory() -> None:
    # stage 1 is three times faster: it gets about three times the layers (the prototype split by memory)
    assert split_layers([3.0, 1.0], [0.0, 0.0], [32, 32], 32) == [8, 24]
    # a memory cap binds: the fast stage can hold only 10 layers
    assert split_layers([3.0, 1.0], [0.0, 0.0], [32, 10], 32) == [22, 10]


def test_layer_split_refuses_degenerate_or_impossible_splits() -> None:
    assert split_layers([1.0] * 5, [0.0] * 5, [10] * 5, 4) is None  # more stages than layers
    assert split_layers([1.0, 1.0], [0.0, 0.0], [3, 0], 4) is None  # a stage that holds no layer
    assert split_layers([1.0, 1.0], [0.0, 0.0], [2, 1], 4) is None  # not enough memory in total
    assert split_layers([1.0], [0.5], [4], 4) == [4]


def _brute_batch(total: int, pace: list[float], fill: list[float], mins: list[int]) -> float:
    best = math.inf
    for counts in itertools.product(*(range(m, total + 1) for m in mins)):
        if sum(counts) == total:
            best = min(best, max(f + c * p for f, c, p in zip(fill, counts, pace, strict=True)))
    return best


def test_batch_split_is_the_exact_min_max() -> None:
    rng = random.Random(3)
    for _ in range(300):
        pipes = rng.randint(1, 3)
        pace = [rng.uniform(0.1, 2.0) for _ in range(pipes)]
        fill = [rng.uniform(0.0, 3.0) for _ in range(pipes)]
        mins = [rng.randint(1, 4) for _ in range(pipes)]
        total = sum(mins) + rng.randint(0, 20)
        counts = split_batch(total, pace, fill, mins)
        assert counts is not None and sum(counts) == total
        assert all(c >= m for c, m in zip(counts, mins, strict=True))
        got = max(f + c * p for f, c, p in zip(fill, counts, pace, strict=True))
        assert got == pytest.approx(_brute_batch(total, pace, fill, mins), rel=1e-12)


def test_batch_split_follows_throughput_and_refuses_too_small_batches() -> None:
    # a pipeline twice as fast gets twice the micro-batches (the prototype split batches uniformly)
    assert split_batch(30, [1.0, 2.0], [0.0, 0.0], [1, 1]) == [20, 10]
    assert split_batch(3, [1.0, 1.0], [0.0, 0.0], [2, 2]) is None
    assert pipeline_time(0.5, 2.0, 5) == pytest.approx(4.0)


def test_micro_batches_must_divide_the_global_batch() -> None:
    assert micro_batches(64, 4) == 16
    with pytest.raises(InfeasibleError, match="not a multiple of micro-batch size 4; use a global batch of 60 or 64"):
        micro_batches(62, 4)


def test_window_pace_predicts_the_simulated_1f1b_period() -> None:
    rng = random.Random(11)
    for _ in range(40):
        stages = rng.randint(2, 8)
        fwd = [rng.uniform(0.02, 0.2) for _ in range(stages)]
        bwd = [2 * f for f in fwd]
        links = [rng.choice([0.0, 0.001, rng.uniform(0.0, 0.3)]) for _ in range(stages - 1)]
        m = 8 * stages
        slope = (simulate_1f1b(fwd, bwd, links, 2 * m).total_s - simulate_1f1b(fwd, bwd, links, m).total_s) / m
        pace = window_pace([f + b for f, b in zip(fwd, bwd, strict=True)], links)
        assert pace == pytest.approx(slope, rel=0.02)


def test_a_split_given_up_at_a_pace_is_slower_than_it() -> None:
    """`split_layers_within` gives up (False) exactly when the split's slowest stage is slower than the pace (it
    would prune a trial that could win otherwise), and else returns the split itself; None where nothing fits."""
    from flashflex_cli.planner.space.layer_split import split_layers_within

    rng = random.Random(13)
    given_up = kept = 0
    for _ in range(3000):
        layers, t, e, caps = _random_stage_terms(rng, 9, 40)
        split = split_layers(t, e, caps, layers)
        if split is None:
            assert split_layers_within(t, e, caps, layers, rng.uniform(0.0, 100.0)) is None
            continue
        slowest = max(stage_times(t, e, split))
        pace = slowest * rng.choice([0.5, 0.97, 0.999, 1.001, 1.03, 2.0])
        within = split_layers_within(t, e, caps, layers, pace)
        if within is False:
            assert slowest > pace * (1.0 - 1e-9)
            given_up += 1
        else:
            assert within == split and slowest <= pace * (1.0 + 1e-9)
            kept += 1
    assert given_up > 300 and kept > 300  # (both answers are exercised: the test is not vacuous)

"""The planner's fast data-parallel term (planner/dp_score.py) charges what the cost model (cost/dp.py) charges:
the same bucket costs, flat and hierarchical, and the same overlapped timeline, so candidates are ranked the way
`cost.estimate` would rank them."""

from __future__ import annotations

import dataclasses

import pytest

from flashflex_cli.cost.dp import bucket_cost
from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model import flops as F
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import TrainConfig
from flashflex_cli.planner.scoring import dp_score
from flashflex_cli.planner.scoring.candidate import build_plan, score
from flashflex_cli.planner.scoring.cost_cache import CostCache
from flashflex_cli.planner.scoring.pipeline_score import evaluate_pipeline
from flashflex_cli.planner.search import scored_candidates
from flashflex_cli.planner.space.graph import DeviceGraph

from .cost_fixtures import cluster, plan, stage

MODEL = PRESETS["llama-small"]


@pytest.mark.parametrize("hierarchical", [True, False])
def test_bucket_seconds_are_the_cost_models(hierarchical: bool) -> None:
    """Six one-device holders, two on each of three nodes joined by 1 GbE: the fast column of one layer is
    cost.dp.bucket_cost's (inside, across, nodes), flat and hierarchical."""
    c = cluster(*[("A100-80G-SXM", 2, "eth", "nvlink")] * 3)
    train = TrainConfig(global_batch=12, seq_len=512)
    pipes = [(2, [stage([f"node{n}/{d}"], 0, MODEL.num_layers)]) for n in range(3) for d in range(2)]
    p = plan(c, MODEL, train, pipes)
    params = CostParams(dp_hierarchical=hierarchical)
    cache = CostCache(DeviceGraph(c, train.dtype), MODEL, train, params)
    inside, across, nodes = bucket_cost(p, c, [(i, 0) for i in range(6)], F.layer_params(MODEL), params)
    fast = dp_score._column(cache, list(range(6)), 1, cache.layer_grad_bytes)
    assert fast[:2] == pytest.approx((inside, across), rel=1e-12)
    assert (inside > 0) == hierarchical
    assert {f"node{n}" for n in fast[2]} == set(nodes) == {"node0", "node1", "node2"}


def test_overlap_and_hierarchy_change_the_fast_score_as_they_change_the_estimate() -> None:
    """The same six pipelines scored under the four switch settings: the fast score moves with the estimate
    and stays within 5% of it (it leaves out the optimizer step and, without overlap, reduces the embedding and
    head in buckets of their own: two more ring latencies of 10 x 50 us on a 30 ms step)."""
    c = cluster(*[("A100-80G-SXM", 2, "eth", "nvlink")] * 3)
    train = TrainConfig(global_batch=12, seq_len=512)
    pipes = [(2, [stage([f"node{n}/{d}"], 0, MODEL.num_layers)]) for n in range(3) for d in range(2)]
    p = plan(c, MODEL, train, pipes)
    got = {}
    for overlap in (True, False):
        for hierarchical in (True, False):
            params = CostParams(dp_overlap=overlap, dp_hierarchical=hierarchical)
            cache = CostCache(DeviceGraph(c, train.dtype), MODEL, train, params)
            evals = [evaluate_pipeline(cache, ((2 * n + d,),)) for n in range(3) for d in range(2)]
            cand = score(cache, evals, 12)
            assert cand is not None
            got[(overlap, hierarchical)] = (cand.score_s, estimate(p, c, params).iteration_time_s)
    for fast, truth in got.values():
        assert fast == pytest.approx(truth, rel=0.05)
    # ranked alike: hierarchical beats flat over 1 GbE either way; at this size per-layer buckets pay more ring
    # latencies than overlap hides, and the fast score sees that as the estimate does
    assert sorted(got, key=lambda k: got[k][0]) == sorted(got, key=lambda k: got[k][1])
    assert got[(True, True)][0] < got[(True, False)][0] and got[(False, True)][0] < got[(False, False)][0]


def _eth10(devices: int) -> str:
    kinds = ("A100-80G-SXM", "RTX-4090", "RTX-3090")
    return ",".join(f"1x8x{kinds[n % 3]}:nic=eth:bw=10" for n in range(devices // 8))


def test_fast_score_ranks_search_candidates_as_the_cost_model_does() -> None:
    """Every candidate the search scores on a 32-GPU 10 GbE cluster (gradient reduction a large part of the
    step): the fast score lies within 5% of `estimate` (it leaves out latencies and the optimizer step and
    takes the closed-form 1F1B time; 3.9% is the largest seen in benchmarks/bench_fast_score.py), while the
    score the planner used before (flat reduction after the whole backward) misses by far more."""
    train = TrainConfig(global_batch=64, seq_len=4096)
    cache, cands = scored_candidates(build_cluster(_eth10(32)), PRESETS["llama2-7b"], train)
    flat = CostCache(cache.graph, cache.model, cache.train,
                     dataclasses.replace(cache.params, dp_overlap=False, dp_hierarchical=False), cache.micro_batch)
    errors, before = [], []
    for cand in cands:
        est = estimate(build_plan(cache, cand, "flashflex", 0, predict=False), cache.graph.cluster, cache.params)
        if not est.fits:
            continue
        errors.append(abs(cand.score_s / est.iteration_time_s - 1))
        old = score(flat, cand.pipes, train.global_batch)
        assert old is not None
        before.append(abs(old.score_s / est.iteration_time_s - 1))
    assert len(errors) >= 10
    assert max(errors) < 0.05
    assert max(before) > 0.2


def test_the_cheap_floor_never_exceeds_the_fast_score_and_lets_refinement_skip_it() -> None:
    """`dp_finish_floor` (the embedding's bucket after the slowest pipeline), for every candidate of a 32-GPU 10 GbE
    search: never above `dp_finish` (compared exactly: it is the same sums in the same order) and, with two or
    more pipelines, above the slowest pipeline's end (else it would prune nothing the plain bound does not);
    `score` with a bound at or below that floor gives None without computing the data-parallel term."""
    from flashflex_cli.cost.schedule import closed_form_s as pipeline_time
    from flashflex_cli.planner.space.batch_split import split_batch

    train = TrainConfig(global_batch=64, seq_len=4096)
    cache, cands = scored_candidates(build_cluster(_eth10(32)), PRESETS["llama2-7b"], train)
    above = 0
    for cand in cands:
        pipes = cand.pipes
        micro = split_batch(train.global_batch, [p.pace_s for p in pipes], [p.fill_s - p.pace_s for p in pipes],
                            [p.num_stages for p in pipes])
        assert micro is not None
        ends = [pipeline_time(p.pace_s, p.fill_s, m) for p, m in zip(pipes, micro, strict=True)]
        floor = dp_score.dp_finish_floor(cache, pipes, ends)
        assert max(ends) <= floor <= dp_score.dp_finish(cache, pipes, ends) == cand.score_s
        if len(pipes) > 1:
            assert floor > max(ends)
            above += 1
            assert score(cache, pipes, train.global_batch, bound=floor) is None
    assert above >= 10


def test_the_floor_from_the_known_pipelines_never_exceeds_the_fast_score() -> None:
    """`dp_finish_below`'s floor (the timeline with only the pipelines whose terms are memoised), for every
    candidate of a 32-GPU 10 GbE search and each pipeline known alone: never above `dp_finish` (compared exactly:
    every later step is monotone in the ready times), at least `dp_finish_floor`, and above it for some; with a
    bound at or below it `dp_finish_below` gives None, with a bound above `dp_finish` its exact figure (most of
    these floors lie above `dp_finish_floor`: the refinement skips more data-parallel terms)."""
    from flashflex_cli.cost.schedule import closed_form_s as pipeline_time
    from flashflex_cli.planner.space.batch_split import split_batch

    train = TrainConfig(global_batch=64, seq_len=4096)
    cache, cands = scored_candidates(build_cluster(_eth10(32)), PRESETS["llama2-7b"], train)
    tighter = checked = 0
    for cand in cands:
        pipes = cand.pipes
        if len(pipes) < 2:
            continue
        micro = split_batch(train.global_batch, [p.pace_s for p in pipes], [p.fill_s - p.pace_s for p in pipes],
                            [p.num_stages for p in pipes])
        assert micro is not None
        ends = [pipeline_time(p.pace_s, p.fill_s, m) for p, m in zip(pipes, micro, strict=True)]
        exact = dp_score.dp_finish(cache, pipes, ends)
        for alone in range(len(pipes)):
            known = [dp_score.pipe_terms(cache, p) if q == alone else None for q, p in enumerate(pipes)]
            floor = dp_score._known_floor(cache, pipes, ends, known)
            assert dp_score.dp_finish_floor(cache, pipes, ends) <= floor <= exact
            tighter += floor > dp_score.dp_finish_floor(cache, pipes, ends)
            checked += 1
        memo = cache.memo(dp_score.DpMemo).terms
        saved = dict(memo)
        memo.clear()
        dp_score.pipe_terms(cache, pipes[0])  # the first pipeline known, the others not
        floor = dp_score._known_floor(cache, pipes, ends, [dp_score.pipe_terms(cache, pipes[0])] +
                                      [None] * (len(pipes) - 1))
        assert dp_score.dp_finish_below(cache, pipes, ends, floor) is None
        memo.clear()
        memo.update(saved)
        assert dp_score.dp_finish_below(cache, pipes, ends, exact * 1.01 + 1e-12) == exact
    assert checked >= 10 and 2 * tighter >= checked

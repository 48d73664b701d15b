"""The quick first pass of a large cluster's search and the descent of its best partitions (planner/search/collect.py).

A cluster of more than THOROUGH_DEVICES devices is searched with each pipeline's best start (one TP degree per node
class: `best_pipeline(descent=False)`), and the coordinate descent runs only on the DESCENDED best partitions within
DESCENT_BAND of the best quick candidate. The cluster: llama2-7b on 64 devices (8 nodes cycling through A100-80G,
4090, 3090, A100-40G), where the descent makes many two-node pipelines faster (by up to 17%).
"""

from __future__ import annotations

import pytest

from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import TrainConfig
from flashflex_cli.planner.scoring.cost_cache import CostCache
from flashflex_cli.planner.search import collect
from flashflex_cli.planner.search.pool import SearchPool
from flashflex_cli.planner.space.graph import DeviceGraph
from flashflex_cli.planner.structure import stage_search
from flashflex_cli.planner.structure.trials import amortised

KINDS = "1x8xA100-80G-SXM:nic=ib:link=nvlink,1x8xRTX-4090:nic=eth,1x8xRTX-3090:nic=eth,1x8xA100-40G-SXM:nic=roce"
TRAIN = TrainConfig(global_batch=64, seq_len=4096)


def _cache(copies: int) -> CostCache:
    cluster = build_cluster(",".join([KINDS] * copies))
    return CostCache(DeviceGraph(cluster, TRAIN.dtype), PRESETS["llama2-7b"], TRAIN, CostParams())


def _node(nodes: tuple[int, ...]) -> list[int]:
    return [i for n in nodes for i in range(8 * n, 8 * n + 8)]


@pytest.mark.parametrize(("nodes", "micro"), [((1, 5), 4), ((2, 3), 4), ((0, 1), 16), ((3, 7), 16), ((0, 4), 16)])
def test_the_quick_structure_is_the_descents_start_and_the_descent_only_improves_it(
        monkeypatch: pytest.MonkeyPatch, nodes: tuple[int, ...], micro: int) -> None:
    """descent=False gives the structure the descent starts from (the search with no rounds of descent), one TP
    degree per node class; the full search costs no more, here strictly less on four of the five groups; each is
    memoised apart from the other, whichever runs first."""
    group = _node(nodes)
    quick_first = _cache(2)
    quick = stage_search.best_pipeline(quick_first, group, micro, 64, descent=False)
    full = stage_search.best_pipeline(quick_first, group, micro, 64)
    full_first = _cache(2)
    assert stage_search.best_pipeline(full_first, group, micro, 64) == full
    assert stage_search.best_pipeline(full_first, group, micro, 64, descent=False) == quick
    assert quick is not None and full is not None
    for node in nodes:
        degrees = {len(stage) for stage in quick.stages if stage[0] // 8 == node}
        assert len(degrees) == 1, (node, quick.stages)
    assert amortised(full, micro, 64) <= amortised(quick, micro, 64)
    monkeypatch.setattr(stage_search, "MAX_ROUNDS", 0)
    assert stage_search.best_pipeline(_cache(2), group, micro, 64) == quick
    if nodes != (0, 4):
        assert amortised(full, micro, 64) < 0.97 * amortised(quick, micro, 64)


@pytest.mark.parametrize("band", [None, 1.1])
def test_a_large_cluster_descends_only_its_best_partitions(monkeypatch: pytest.MonkeyPatch, band: float | None) -> None:
    """64 devices: every unit of both phases is a quick pass over all partitions; then one unit per partition of the
    DESCENDED best quick candidates within DESCENT_BAND of the best (with the default band more than DESCENDED
    qualify, so the count decides; with 1.1, fewer, so the band does), each a candidate beside the quick one, some
    of them other layouts (the descent improves each pipeline alone: the layout can score better or worse, for its
    data-parallel reductions between unlike pipelines, and the final ranking sees both)."""
    if band is not None:
        monkeypatch.setattr(collect, "DESCENT_BAND", band)
    ran: list[tuple] = []
    unit = collect.collect_unit

    def recorded(cache: CostCache, item: collect.Unit) -> tuple:
        result = unit(cache, item)
        ran.append((item, result))
        return result

    monkeypatch.setattr(collect, "collect_unit", recorded)
    cache = _cache(2)
    with SearchPool(cache, 1) as pool:
        found = collect.collect_candidates(pool, 64, 0, float("inf"), collect.SearchStats())
    quick = [(item, result) for item, result in ran if not item.descent]
    descended = [(item, result) for item, result in ran if item.descent]
    assert quick and all(item.only is None for item, _ in quick)
    assert ran == quick + descended  # the descent after both phases
    first = [cand for _, (cands, *_rest) in quick for cand in cands]
    origins = [origin for _, (_cands, where, *_rest) in quick for origin in where]
    assert found[:len(first)] == first and len(origins) == len(first)
    best = min(c.score_s for c in first)
    within = [j for j in sorted(range(len(first)), key=lambda j: (first[j].score_s, first[j].signature()))
              if first[j].score_s <= collect.DESCENT_BAND * best]
    assert 0 < len(within) < len(first)
    assert (len(within) > collect.DESCENDED) == (band is None)
    within = within[:collect.DESCENDED]
    assert [(item.k, item.active, item.only) for item, _ in descended] == [origins[j] for j in within]
    for j, (_item, (cands, where, *_rest)) in zip(within, descended, strict=True):
        assert where == [origins[j]] and len(cands) == 1
    changed = [cands[0].score_s / first[j].score_s for j, (_, (cands, *_r)) in zip(within, descended, strict=True)
               if cands[0].signature() != first[j].signature()]
    if band is None:
        assert changed and min(changed) < 1.0
    assert found[len(first):] == [cands[0] for _, (cands, *_r) in descended]


def test_a_small_cluster_descends_every_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most THOROUGH_DEVICES devices: every unit runs the descent on all its partitions, no second pass."""
    ran: list[tuple] = []
    unit = collect.collect_unit
    monkeypatch.setattr(collect, "collect_unit", lambda cache, item: ran.append(item) or unit(cache, item))
    cache = _cache(1)
    assert cache.graph.size <= stage_search.THOROUGH_DEVICES
    with SearchPool(cache, 1) as pool:
        collect.collect_candidates(pool, 64, 0, float("inf"), collect.SearchStats())
    assert ran and all(item.descent and item.only is None for item in ran)

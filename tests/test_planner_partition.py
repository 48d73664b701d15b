"""Level 1 (device graph, pymetis and the other partition generators) and level 2 (stage structures)."""

from __future__ import annotations

import pytest

from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import TrainConfig
from flashflex_cli.planner.scoring.cost_cache import CostCache
from flashflex_cli.planner.space.graph import DeviceGraph
from flashflex_cli.planner.space.partition import device_subsets, generators, metis_groups
from flashflex_cli.planner.structure.stage_search import best_pipeline, size_options

SPEC = "1x4xA100-80G-SXM:nic=eth,1x4xRTX-4090:nic=eth,1x2xRTX-3090:nic=eth"


def test_the_metis_graph_weights_fast_links_heavier_and_cuts_the_slow_ones() -> None:
    graph = DeviceGraph(build_cluster(SPEC), "bf16")
    xadj, adjncy, weights = graph.csr()
    assert len(xadj) == graph.size + 1
    inside = [w for i in range(graph.size) for e, w in zip(adjncy[xadj[i]:xadj[i + 1]], weights[xadj[i]:xadj[i + 1]],
                                                            strict=True) if graph.node[e] == graph.node[i]]
    across = [w for i in range(graph.size) for e, w in zip(adjncy[xadj[i]:xadj[i + 1]], weights[xadj[i]:xadj[i + 1]],
                                                           strict=True) if graph.node[e] != graph.node[i]]
    assert min(inside) > max(across)
    equal = DeviceGraph(build_cluster("3x4xRTX-4090:nic=eth"), "bf16")
    groups = metis_groups(equal, 3, seed=0, active=range(equal.size))
    assert sorted(sorted({int(equal.node[i]) for i in g}) for g in groups) == [[0], [1], [2]]  # whole nodes


@pytest.mark.parametrize("k", [1, 2, 3, 5, 10])
def test_every_generator_partitions_the_devices(k: int) -> None:
    graph = DeviceGraph(build_cluster(SPEC), "bf16")
    for name, groups in generators(graph, k, seed=1):
        flat = sorted(i for g in groups for i in g)
        assert flat == list(range(graph.size)), name
        assert all(groups) and len(groups) <= k
        assert groups == sorted(groups, key=lambda g: g[0])  # canonical order


def test_striped_groups_keep_every_pipeline_on_every_node() -> None:
    graph = DeviceGraph(build_cluster("2x4xRTX-4090:nic=eth"), "bf16")
    striped = dict(generators(graph, 2, seed=0))["striped"]
    assert [sorted({int(graph.node[i]) for i in g}) for g in striped] == [[0, 1], [0, 1]]


def test_device_subsets_drop_the_slowest_kinds_first() -> None:
    graph = DeviceGraph(build_cluster(SPEC), "bf16")
    subsets = device_subsets(graph)
    assert subsets[0] == list(range(graph.size))
    assert subsets[1] == list(range(8))  # without the two 3090s (slowest)
    assert subsets[2] == list(range(4))  # A100s only


def test_size_options_include_mixed_tp_groups() -> None:
    assert (2, 1, 1) in size_options(4, [1, 2, 4]) and (1, 2, 1) in size_options(4, [1, 2, 4])
    assert (4,) == size_options(4, [1, 2, 4])[0]


def test_level_two_keeps_tp_groups_inside_nodes_and_fits_memory() -> None:
    cluster = build_cluster(SPEC)
    cache = CostCache(DeviceGraph(cluster, "bf16"), PRESETS["llama2-7b"], TrainConfig(global_batch=32, seq_len=2048),
                      CostParams())
    pipe = best_pipeline(cache, list(range(cache.graph.size)), 32, 32)
    assert pipe is not None and pipe.ok and sum(pipe.counts) == 32
    for stage in pipe.stages:
        assert len({int(cache.graph.node[i]) for i in stage}) == 1
    assert best_pipeline(cache, [8, 9], 32, 32) is None  # two 24 GiB cards cannot hold llama2-7b's states

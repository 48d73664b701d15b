"""plan_layout: determinism, no degenerate plans, baselines, unused devices, infeasible input."""

from __future__ import annotations

import random

import pytest

from flashflex_cli.cost.estimate import estimate
from flashflex_cli.errors import InfeasibleError, InputError
from flashflex_cli.hardware.cluster import Cluster
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model.spec import PRESETS, ModelSpec
from flashflex_cli.plan.schema import Plan, TrainConfig
from flashflex_cli.planner.search import plan_layout
from flashflex_cli.planner.space.tp_groups import tp_degrees

GIB = 1024**3
HETERO = "1x4xA100-80G-SXM:nic=ib,1x4xRTX-4090:nic=eth,1x4xRTX-3090:nic=eth"


def _check_not_degenerate(plan: Plan, cluster: Cluster) -> None:
    ids = set(cluster.device_ids)
    listed = {r.device for r in plan.ranks()} | {u.device for u in plan.unused_devices}
    assert listed == ids  # every device is used or said to be unused
    for pipe in plan.pipelines:
        assert pipe.num_micro_batches >= len(pipe.stages)
        for stage in pipe.stages:
            assert stage.num_layers >= 1 and stage.devices
            assert len({cluster.node_of(d) for d in stage.devices}) == 1  # TP never straddles a node
    assert plan.predicted is not None and plan.predicted["fits"]


def test_same_inputs_and_seed_give_a_byte_identical_plan() -> None:
    cluster = build_cluster(HETERO)
    train = TrainConfig(global_batch=64, seq_len=2048)
    first = plan_layout(cluster, PRESETS["llama2-7b"], train, time_budget_s=60, seed=3)
    again = plan_layout(cluster, PRESETS["llama2-7b"], train, time_budget_s=60, seed=3)
    assert first.to_json() == again.to_json()
    _check_not_degenerate(first, cluster)
    assert first.inputs.seed == 3 and first.inputs.strategy == "flashflex"
    assert first.predicted == estimate(first, cluster).to_predicted()  # the plan stores the cost model's figures


def test_flashflex_is_never_below_uniform_and_beats_it_on_a_skewed_cluster() -> None:
    cluster = build_cluster(HETERO)
    train = TrainConfig(global_batch=64, seq_len=2048)
    ours = plan_layout(cluster, PRESETS["llama2-7b"], train, time_budget_s=60)
    base = plan_layout(cluster, PRESETS["llama2-7b"], train, strategy="uniform")
    _check_not_degenerate(base, cluster)
    tps = [s.tp for p in base.pipelines for s in p.stages]
    assert len(set(tps)) == 1 and len({p.num_micro_batches for p in base.pipelines}) == 1
    assert len({len(p.stages) for p in base.pipelines}) == 1
    assert ours.predicted["tokens_per_s"] >= base.predicted["tokens_per_s"] * 1.05


def test_emulated_cpu_cluster_gets_asymmetric_micro_batches() -> None:
    cluster = build_cluster("1x4xcpu:slowdown=1,1,2,2")
    train = TrainConfig(global_batch=16, seq_len=128, dtype="fp32")
    plan = plan_layout(cluster, PRESETS["llama-small"], train, time_budget_s=30)
    _check_not_degenerate(plan, cluster)
    counts = sorted(p.num_micro_batches for p in plan.pipelines)
    assert len(counts) >= 2 and counts[0] < counts[-1]  # the slow devices' pipeline gets fewer


def test_a_device_too_small_to_hold_a_layer_is_left_unused_and_says_why() -> None:
    base = build_cluster("1x4xA100-80G-SXM:nic=ib")
    data = base.model_dump(mode="json", by_alias=True)
    tiny = dict(data["nodes"][0]["devices"][0], memory_bytes=2 * GIB, type="tiny", source="measured",
                achieved_flops={"bf16": 1e12})
    data["nodes"].append({"name": "small", "nic": "eth", "devices": [tiny]})
    cluster = Cluster.model_validate(data)
    plan = plan_layout(cluster, PRESETS["llama2-7b"], TrainConfig(global_batch=32, seq_len=2048), time_budget_s=30)
    _check_not_degenerate(plan, cluster)
    reasons = {u.device: u.reason for u in plan.unused_devices}
    assert "small/0" in reasons and reasons["small/0"].startswith("too small: ")
    assert "cannot hold one layer" in reasons["small/0"]


def test_tp_degrees_are_every_divisor_not_only_powers_of_two() -> None:
    model = ModelSpec(name="heads12", hidden_size=768, num_layers=6, num_heads=12, num_kv_heads=12,
                      intermediate_size=3072, vocab_size=256)
    assert tp_degrees(model, 8) == [1, 2, 3, 4, 6]
    cluster = build_cluster("1x6xcpu")
    plan = plan_layout(cluster, model, TrainConfig(global_batch=12, seq_len=64, dtype="fp32"), time_budget_s=30)
    _check_not_degenerate(plan, cluster)


def test_infeasible_requests_name_what_is_needed_against_what_there_is() -> None:
    cluster = build_cluster("1x2xRTX-4090")
    with pytest.raises(InfeasibleError, match=r"llama2-70b needs at least .* TiB .*; the cluster has .* GiB usable"):
        plan_layout(cluster, PRESETS["llama2-70b"], TrainConfig(global_batch=8, seq_len=4096))
    with pytest.raises(InfeasibleError, match="not a multiple of micro-batch size"):
        plan_layout(cluster, PRESETS["llama-tiny"], TrainConfig(global_batch=7, seq_len=64), micro_batch=2)
    with pytest.raises(InputError, match="unknown strategy"):
        plan_layout(cluster, PRESETS["llama-tiny"], TrainConfig(global_batch=8, seq_len=64), strategy="magic")


def test_exhaustive_refuses_large_clusters_and_bounds_flashflex() -> None:
    with pytest.raises(InputError, match="at most 12 devices; the cluster has 16"):
        plan_layout(build_cluster("2x8xRTX-4090"), PRESETS["llama-small"], TrainConfig(global_batch=8, seq_len=64),
                    strategy="exhaustive")
    cluster = build_cluster("1x2xA100-80G-SXM:nic=ib,1x2xRTX-4090:nic=eth,1x1xRTX-3090:nic=eth")
    train = TrainConfig(global_batch=32, seq_len=2048)
    best = plan_layout(cluster, PRESETS["llama2-7b"], train, strategy="exhaustive")
    ours = plan_layout(cluster, PRESETS["llama2-7b"], train, time_budget_s=30)
    _check_not_degenerate(best, cluster)
    assert ours.predicted["tokens_per_s"] <= best.predicted["tokens_per_s"] * 1.0001
    assert ours.predicted["tokens_per_s"] >= best.predicted["tokens_per_s"] * 0.99  # observed: 0.997


SMALL_TYPES = ("A100-80G-SXM", "A100-40G-SXM", "H100-SXM", "L40S", "RTX-4090", "RTX-3090", "V100-32G")


def _small_unlike_cluster(rng: random.Random) -> str | None:
    """A spec of 2 or 3 nodes of 1 to 3 devices each, with at least two device types and two kinds of link (NIC
    class and bandwidth drawn per node); None when the draw has one type or one kind of link."""
    nodes = [(rng.randint(1, 3), rng.choice(SMALL_TYPES), rng.choice(("ib", "roce", "eth")),
              rng.choice((10, 25, 100, 200))) for _ in range(rng.randint(2, 3))]
    if len({n[1] for n in nodes}) < 2 or len({n[2:] for n in nodes}) < 2:
        return None
    return ",".join(f"1x{count}x{kind}:nic={nic}:bw={gbps}" for count, kind, nic, gbps in nodes)


# The first twelve draws of `_small_unlike_cluster` (seeds 0 to 24) that hold llama2-7b: the others have one device
# type or one kind of link, or too little memory. Two of them show where flashflex's structure search still misses
# the optimum that exhaustive search finds (the same devices, another stage order: the search scores a structure by
# its time per micro-batch, which leaves out the optimizer step of each stage).
KNOWN_GAP = pytest.mark.xfail(strict=True, reason="flashflex's stage order misses the optimum (0.984 and 0.947)")
NEAR_OPTIMAL_SEEDS = [0, 2, 3, 4, 5, 9, pytest.param(12, marks=KNOWN_GAP), 16, 17, 19, 23,
                      pytest.param(24, marks=KNOWN_GAP)]


@pytest.mark.parametrize("seed", NEAR_OPTIMAL_SEEDS)
def test_flashflex_is_within_one_percent_of_exhaustive_search_on_small_unlike_clusters(seed: int) -> None:
    """2 to 7 devices: exhaustive search takes at most a second. It ranks every layout by the planner's fast score
    and its finalists by `estimate`, so flashflex can also come out ahead of it (1.014 on seed 4). Observed
    (2026-11-28): 0.9967 (seeds 2 and 3), 0.9997 (16), 1.000 elsewhere; seed 33 planned "no layout fits" before the
    structure search descended from starts that do not fit (it now finds the optimum)."""
    spec = _small_unlike_cluster(random.Random(seed))
    assert spec is not None
    cluster, train = build_cluster(spec), TrainConfig(global_batch=32, seq_len=2048)
    best = plan_layout(cluster, PRESETS["llama2-7b"], train, strategy="exhaustive")
    ours = plan_layout(cluster, PRESETS["llama2-7b"], train, time_budget_s=60)
    _check_not_degenerate(ours, cluster)
    ratio = ours.predicted["tokens_per_s"] / best.predicted["tokens_per_s"]
    assert ratio >= 0.99, f"{spec}: flashflex {ratio:.4f} of exhaustive search"


def test_a_pipeline_that_fits_only_with_unlike_group_sizes_is_found() -> None:
    """Six devices that fit llama2-7b only as one pipeline whose A100 node has a TP-2 and a TP-1 stage and whose
    RTX 4090 node three TP-1 stages (seed 33 of `_small_unlike_cluster`): no start of the structure search (one
    degree per node) fits, and the descent from them finds the layout exhaustive search finds."""
    cluster = build_cluster("1x3xA100-40G-SXM:nic=roce:bw=200,1x3xRTX-4090:nic=eth:bw=25")
    train = TrainConfig(global_batch=32, seq_len=2048)
    best = plan_layout(cluster, PRESETS["llama2-7b"], train, strategy="exhaustive")
    ours = plan_layout(cluster, PRESETS["llama2-7b"], train, time_budget_s=60)
    _check_not_degenerate(ours, cluster)
    assert sorted(stage.tp for stage in ours.pipelines[0].stages) == [1, 1, 1, 1, 2]
    assert ours.predicted["tokens_per_s"] >= best.predicted["tokens_per_s"] * 0.99


def test_a_zero_time_budget_still_gives_a_valid_plan_and_says_it_was_cut() -> None:
    from flashflex_cli.planner.search import SearchStats

    cluster = build_cluster(HETERO)
    stats = SearchStats()
    plan = plan_layout(cluster, PRESETS["llama2-7b"], TrainConfig(global_batch=64, seq_len=2048), time_budget_s=0,
                       stats=stats)
    _check_not_degenerate(plan, cluster)
    assert stats.budget_hit


def test_idle_devices_say_how_much_faster_leaving_them_idle_is() -> None:
    cluster = build_cluster("1x8xA100-80G-SXM:nic=ib,1x8xRTX-3080Ti:nic=eth:bw=1")
    plan = plan_layout(cluster, PRESETS["llama2-13b"], TrainConfig(global_batch=32, seq_len=4096), time_budget_s=30)
    _check_not_degenerate(plan, cluster)
    reasons = [u.reason for u in plan.unused_devices]
    assert reasons, "the 12 GiB cards behind 1 Gbit/s Ethernet should not help a 13B model here"
    assert all("faster" in r or r.startswith("too small") for r in reasons)


def test_too_few_micro_batches_for_the_stages_memory_needs_is_infeasible() -> None:
    cluster = build_cluster("8x1xRTX-4090:nic=eth")  # one GPU per node: no TP, so pipelines need many stages
    with pytest.raises(InfeasibleError, match=r"gives 2 micro-batches .* 1F1B needs a micro-batch per stage; "
                                              r"use a global batch of at least \d+"):
        plan_layout(cluster, PRESETS["llama2-7b"], TrainConfig(global_batch=2, seq_len=1024, recompute=True),
                    time_budget_s=30)


def test_pipeline_counts_leave_each_pipeline_the_memory_for_the_model_state() -> None:
    """llama2-7b's weights, gradients and optimizer state need two 80 GB devices, so 16 of them make at most 8
    pipelines (counting one device per pipeline, as rounding the ratio down did, offered 16)."""
    import math

    from flashflex_cli.cost.params import CostParams
    from flashflex_cli.planner.scoring.cost_cache import CostCache
    from flashflex_cli.planner.scoring.feasibility import model_state_bytes
    from flashflex_cli.planner.search.collect import pipeline_counts
    from flashflex_cli.planner.space.graph import DeviceGraph

    train = TrainConfig(global_batch=1024, seq_len=4096)
    cache = CostCache(DeviceGraph(build_cluster("2x8xA100-80G-SXM:nic=ib"), train.dtype), PRESETS["llama2-7b"], train,
                      CostParams())
    usable = cache.capacity((0,)) - cache.params.memory_reserve_bytes
    assert math.ceil(model_state_bytes(cache) / usable) == 2
    assert pipeline_counts(cache, 1024) == list(range(1, 9))


def test_pipeline_counts_past_the_sure_ones_stop_where_they_cannot_pay_and_go_on_where_they_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past SURE_KS pipelines, k grows TAIL_BATCH at a time until a batch's best new candidate is TAIL_STOP times
    slower than the best found. llama2-7b on 128 mixed devices: 9 and 10 pipelines are far slower, so 11..54 are
    left out, and the whole search finds nothing better: the same plan (the idle devices' reasons compare with
    the candidates scored, so they are left out of the comparison). llama-tiny on 64 H100s: more pipelines pay
    (the plan runs more than DENSE_KS), so every k is searched."""
    from flashflex_cli.cost.params import CostParams
    from flashflex_cli.planner.scoring.cost_cache import CostCache
    from flashflex_cli.planner.search import collect as search
    from flashflex_cli.planner.search.pool import SearchPool
    from flashflex_cli.planner.space.graph import DeviceGraph

    ran: list[int] = []
    unit = search.collect_unit
    monkeypatch.setattr(search, "collect_unit", lambda cache, item: ran.append(item.k) or unit(cache, item))
    spec = ("1x8xA100-80G-SXM:nic=ib:link=nvlink,1x8xRTX-4090:nic=eth,1x8xRTX-3090:nic=eth,1x8xA100-40G-SXM:nic=roce,"
            * 4).rstrip(",")
    cluster, train = build_cluster(spec), TrainConfig(global_batch=256, seq_len=4096)
    cache = CostCache(DeviceGraph(cluster, train.dtype), PRESETS["llama2-7b"], train, CostParams())
    ks = search.pipeline_counts(cache, 256)
    assert ks == [*range(1, search.DENSE_KS + 1), 24, 36, 54]
    found = {}
    for every in (True, False):
        ran.clear()
        with SearchPool(cache, 1) as pool:
            cands = search.collect_candidates(pool, 256, 0, float("inf"), search.SearchStats(), every_k=every)
        found[every] = (ran[:ran.index(1, 1)], min(c.score_s for c in cands))  # (phase 2 starts again at k = 1)
    assert found[True][0] == ks and found[False][0] == list(range(1, 11))
    assert found[False][1] == found[True][1]

    def layout(plan: Plan) -> list:
        return [[(s.devices, s.layers) for s in p.stages] + [p.num_micro_batches] for p in plan.pipelines]

    plan = plan_layout(cluster, PRESETS["llama2-7b"], train, time_budget_s=600)
    monkeypatch.setattr(search, "TAIL_STOP", float("inf"))
    every = plan_layout(cluster, PRESETS["llama2-7b"], train, time_budget_s=600)
    assert layout(plan) == layout(every) and plan.predicted == every.predicted

    ran.clear()
    cluster, train = build_cluster("8x8xH100-SXM:nic=ib"), TrainConfig(global_batch=512, seq_len=512)
    small = plan_layout(cluster, PRESETS["llama-tiny"], train, time_budget_s=600)
    assert len(small.pipelines) > search.DENSE_KS
    cache = CostCache(DeviceGraph(cluster, train.dtype), PRESETS["llama-tiny"], train, CostParams())
    assert set(search.pipeline_counts(cache, 512)) <= set(ran) and max(ran) > search.DENSE_KS

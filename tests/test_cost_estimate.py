"""estimate(plan, cluster): end-to-end iteration time, DP reduction, MFU, memory problems, stable output."""

from __future__ import annotations

import json

import pytest

from flashflex_cli.cost.compute import layer_times
from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.params import CostParams
from flashflex_cli.model import flops as F
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan, TrainConfig

from .cost_fixtures import cluster, plan, stage

MODEL = PRESETS["llama2-7b"]


def test_single_device_iteration_is_compute_plus_optimizer() -> None:
    model = PRESETS["llama-small"]
    c = cluster(("A100-80G-SXM", 1, "ib", "nvlink"))
    train = TrainConfig(global_batch=4, seq_len=512)
    p = plan(c, model, train, [(4, [stage(["node0/0"], 0, model.num_layers)])])
    est = estimate(p, c)
    lt = layer_times(c, ["node0/0"], model, train, CostParams(), micro_batch_size=1)
    per_mb = model.num_layers * (lt.fwd_s + lt.bwd_s) + lt.embed_fwd_s + lt.embed_bwd_s + lt.head_fwd_s + lt.head_bwd_s
    assert est.pipelines[0].time_s == pytest.approx(4 * per_mb)
    n = F.total_params(model)  # embedding, layers, final norm and head
    # a GPU steps with torch's fused AdamW: 12 bytes per parameter for the gradient norm and clipping, 28 for the
    # one pass over parameter, gradient and moments
    optimizer = n * (12 + 28) / (2039e9 * CostParams().memory_bandwidth_efficiency)
    assert est.optimizer_s == pytest.approx(optimizer, rel=1e-3)
    assert est.iteration_time_s == pytest.approx(4 * per_mb + est.optimizer_s)
    assert est.tokens_per_s == pytest.approx(4 * 512 / est.iteration_time_s)
    assert est.mfu == pytest.approx(est.model_flops_per_token * est.tokens_per_s / 312e12)
    assert est.dp_exposed_s == 0 and est.fits and est.problems == []


def two_pipelines(nic: str, overrides: dict | None = None):
    c = cluster(("A100-80G-SXM", 4, nic, "nvlink"), ("A100-80G-SXM", 4, nic, "nvlink"))
    train = TrainConfig(global_batch=32, seq_len=4096)
    pipes = [(16, [stage([f"node{n}/0", f"node{n}/1"], 0, 16), stage([f"node{n}/2", f"node{n}/3"], 16, 32)])
             for n in range(2)]
    p = plan(c, MODEL, train, pipes)
    return estimate(p, c, CostParams.from_overrides(overrides or {}))


def test_dp_reduction_over_slow_links_is_exposed() -> None:
    fast, slow = two_pipelines("ib"), two_pipelines("eth")
    assert fast.pipelines[0].time_s == pytest.approx(slow.pipelines[0].time_s)
    assert 0 < fast.dp_exposed_s < slow.dp_exposed_s
    # eth: both stages of a pipeline sit on one node, so each stage's gradients (fp32, the runtime's
    # grad_reduce_bytes; the TP slices' rings share the NIC too) cross that node's NIC in 2-rings at
    # 1.25 GB/s: 2 steps of half the data. dp_s is a stage's own reductions (one bucket per layer, plus the
    # embedding on the first and the final norm and head on the last stage; 2 x 50 us latency each).
    latency = 2 * 5e-5
    first = (16 * F.layer_params(MODEL) + F.embedding_params(MODEL)) * 4
    last = (16 * F.layer_params(MODEL) + F.head_params(MODEL)) * 4  # head_params: final norm and head
    assert slow.stages[0].dp_s == pytest.approx(first / 1.25e9 + 17 * latency, rel=1e-6)
    assert slow.stages[1].dp_s == pytest.approx(last / 1.25e9 + 18 * latency, rel=1e-6)
    # both stages' buckets queue on the one NIC, so the first stage's reduction ends after all of them; only
    # what runs during the last stage's last backward and the first stage's last backward can hide
    whole = slow.stages[0].dp_s + slow.stages[1].dp_s
    can_hide = slow.stages[0].bwd_s + slow.stages[1].bwd_s + slow.stages[0].p2p_s
    assert whole - can_hide <= slow.stages[0].dp_exposed_s < whole
    assert slow.iteration_time_s > fast.iteration_time_s
    assert slow.iteration_time_s == pytest.approx(slow.pipelines[0].time_s + slow.dp_exposed_s + slow.optimizer_s,
                                                  rel=0.01)


def test_dp_inside_one_node_runs_per_stage() -> None:
    # both pipelines inside one NVLink node: no NIC, each stage reduces only its own layers
    c = cluster(("A100-80G-SXM", 8, "ib", "nvlink"))
    pipes = [(8, [stage([f"node0/{4 * p}", f"node0/{4 * p + 1}"], 0, 8),
                  stage([f"node0/{4 * p + 2}", f"node0/{4 * p + 3}"], 8, 32)]) for p in range(2)]
    est = estimate(plan(c, MODEL, TrainConfig(global_batch=16, seq_len=4096), pipes), c)
    first, second = est.stages[0], est.stages[1]
    shard = F.layer_params(MODEL) / 2 * 4  # one layer's TP-2 shard of fp32 gradients
    assert first.dp_s == pytest.approx((8 * shard + F.embedding_params(MODEL) * 2) / 300e9, rel=0.01)
    assert second.dp_s == pytest.approx((24 * shard + F.head_params(MODEL) * 2) / 300e9, rel=0.01)


def test_dp_overlap_fraction_is_ignored_and_overlap_can_be_switched_off() -> None:
    base, old = two_pipelines("eth"), two_pipelines("eth", {"dp_overlap_fraction": 0.99})
    assert old.iteration_time_s == base.iteration_time_s  # the overlap is simulated per layer now
    off = two_pipelines("eth", {"dp_overlap": False})
    assert [s.dp_s for s in off.stages] == pytest.approx([s.dp_s for s in base.stages], rel=1e-3)
    hidden = off.dp_exposed_s - base.dp_exposed_s
    # the last stage's layers reduce during the first stage's backward; at most a backward's worth hides
    assert 0 < hidden <= sum(s.bwd_s for s in base.stages[:2]) + 1e-9


def test_asymmetric_plan_reduces_each_layer_among_its_holders() -> None:
    c = cluster(("A100-80G-SXM", 8, "eth", "nvlink"), ("RTX-4090", 4, "eth", "pcie"))
    train = TrainConfig(global_batch=24, seq_len=2048)
    pipes = [
        (16, [stage(["node0/0", "node0/1", "node0/2", "node0/3"], 0, 20), stage(["node0/4", "node0/5"], 20, 32)]),
        (8, [stage(["node1/0", "node1/1"], 0, 12), stage(["node1/2"], 12, 24), stage(["node1/3"], 24, 32)]),
    ]
    est = estimate(plan(c, MODEL, train, pipes), c)
    by_key = {(s.pipeline, s.stage): s for s in est.stages}
    # every bucket (one per layer, the embedding, final norm and head) crosses the one Ethernet link between the
    # nodes as a 2-ring at the smaller TP's shard volume x that TP (the slices share the NIC): 2 steps of half
    # its fp32 gradient. Each pipeline holds every bucket in exactly one stage, so its stages' dp_s add up to
    # the whole model's gradient
    model_bytes = F.total_params(MODEL) * 4
    for p in range(2):
        got = sum(s.dp_s for s in est.stages if s.pipeline == p)
        assert got == pytest.approx(model_bytes / 1.25e9, rel=1e-3)
    assert by_key[(0, 0)].dp_s == pytest.approx((20 * F.layer_params(MODEL) + F.embedding_params(MODEL)) * 4
                                                 / 1.25e9, rel=1e-3)
    # the NIC is one channel: the reduction ends, for everyone, after all of it has crossed
    assert est.dp_exposed_s > 0
    # 4090s are slower per device: the second pipeline is the slow one per micro-batch
    assert est.pipelines[1].tokens == 8 * 2048 and est.pipelines[0].tokens == 16 * 2048
    assert est.peak_flops_used == pytest.approx(6 * 312e12 + 4 * 165.2e12)
    assert 0 < est.mfu < 0.7


def test_recompute_trades_time_for_memory() -> None:
    c = cluster(("A100-80G-SXM", 4, "ib", "nvlink"))
    pipes = [(8, [stage(["node0/0", "node0/1"], 0, 16), stage(["node0/2", "node0/3"], 16, 32)])]
    plain = estimate(plan(c, MODEL, TrainConfig(global_batch=8, seq_len=4096), pipes), c)
    again = estimate(plan(c, MODEL, TrainConfig(global_batch=8, seq_len=4096, recompute=True), pipes), c)
    assert again.iteration_time_s > plain.iteration_time_s
    assert again.mfu < plain.mfu  # recompute is not model FLOPs
    assert again.stages[0].memory.activations < plain.stages[0].memory.activations


def test_out_of_memory_is_a_problem_not_an_exception() -> None:
    c = cluster(("T4", 2, "eth", "pcie"))
    pipes = [(4, [stage(["node0/0"], 0, 16), stage(["node0/1"], 16, 32)])]
    est = estimate(plan(c, MODEL, TrainConfig(global_batch=4, seq_len=4096), pipes), c)
    assert not est.fits
    assert est.problems[0].startswith("pipelines.0.stages.0: needs ")
    assert "node0/0 allows 15.2 GiB" in est.problems[0]
    assert est.stages[0].headroom_bytes < 0


def test_slowdown_slows_the_pipeline() -> None:
    from flashflex_cli.hardware.cluster import Cluster

    from .cost_fixtures import device

    def cpu_cluster(slow: float) -> Cluster:
        return Cluster.model_validate({"name": "emu", "nodes": [{"name": "host", "nic": "eth",
            "intra_link": {"kind": "shm"}, "devices": [device("cpu", 1.0), device("cpu", slow)]}]})

    model, train = PRESETS["llama-tiny"], TrainConfig(global_batch=4, seq_len=64, dtype="fp32")
    times = []
    for slow in (1.0, 3.0):
        c = cpu_cluster(slow)
        times.append(estimate(plan(c, model, train, [(4, [stage(["host/0"], 0, 2), stage(["host/1"], 2, 4)])]),
                              c).iteration_time_s)
    assert times[1] > 1.5 * times[0]


def test_predicted_is_rounded_stable_and_fits_the_plan() -> None:
    est = two_pipelines("eth")
    predicted = est.to_predicted()
    for key in ("iteration_time_s", "tokens_per_s", "mfu", "fits", "stages"):
        assert key in predicted
    assert set(predicted["stages"][0]) >= {"time_s", "memory_bytes", "headroom_bytes"}
    assert predicted["iteration_time_s"] == float(f"{est.iteration_time_s:.6g}")
    assert json.dumps(predicted) == json.dumps(two_pipelines("eth").to_predicted())
    c = cluster(("A100-80G-SXM", 4, "eth", "nvlink"), ("A100-80G-SXM", 4, "eth", "nvlink"))
    pipes = [(16, [stage([f"node{n}/0", f"node{n}/1"], 0, 16), stage([f"node{n}/2", f"node{n}/3"], 16, 32)])
             for n in range(2)]
    p = plan(c, MODEL, TrainConfig(global_batch=32, seq_len=4096), pipes)
    stored = Plan.model_validate({**json.loads(p.to_json()), "predicted": predicted})
    assert Plan.model_validate_json(stored.to_json()).predicted == predicted

"""Cost model and planner of low-communication training (issue 32, item 3): sites, the round's cost, --sync."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from flashflex_cli.cost.comm import ring_allreduce_seconds, ring_link
from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.outer_sync import cross_bytes, cross_bytes_per_token, group_plan, round_estimate
from flashflex_cli.cost.params import CostParams
from flashflex_cli.errors import InputError
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model.flops import total_params
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.predicted import Predicted
from flashflex_cli.plan.schema import Plan, TrainConfig
from flashflex_cli.planner.search import plan_layout
from flashflex_cli.planner.search.replica_groups import (
    batch_shares,
    choose_sync,
    fleet_sites,
    inner_steps_for,
    parse_inner_steps,
)
from flashflex_cli.semantics.process_groups import outer_slice_holders
from tests.conftest import FLASHFLEX

SLOW = "2x4xA100-80G-SXM:nic=eth:bw=1"  # two nodes joined by 1 Gbit/s Ethernet
FAST = "2x4xA100-80G-SXM:nic=ib"
ISLANDS = "2x8xA100-80G-SXM:nic=ib,2x8x4090:nic=eth:bw=10"
TRAIN = TrainConfig(global_batch=32, seq_len=1024)
MODEL = PRESETS["llama2-7b"]


def planner(model=MODEL):  # type: ignore[no-untyped-def]
    return lambda cluster, train: plan_layout(cluster, model, train, time_budget_s=5)


def test_sites_cut_along_slow_links_only() -> None:
    assert fleet_sites(build_cluster(FAST)) == [["node0", "node1"]]
    assert fleet_sites(build_cluster(SLOW)) == [["node0"], ["node1"]]  # alike but slow: every node its own
    assert fleet_sites(build_cluster(ISLANDS)) == [["node0", "node1"], ["node2"], ["node3"]]


def test_shares_and_inner_steps() -> None:
    assert batch_shares(10, [1.0, 1.0, 2.0]) == [3, 2, 5]
    assert sum(batch_shares(7, [0.3, 0.3, 0.4])) == 7
    assert inner_steps_for([2.0, 1.0, 0.5], 10) == [10, 20, 40]  # rounds end together


@pytest.mark.parametrize(("text", "ok"), [("8", (8, 8)), ("4:64", (4, 64)), ("9:3", None), ("0", None),
                                          ("a:b", None), ("1:2:3", None)])
def test_inner_steps_range(text: str, ok: tuple[int, int] | None) -> None:
    if ok is None:
        with pytest.raises(InputError, match="--inner-steps"):
            parse_inner_steps(text)
    else:
        assert parse_inner_steps(text) == ok


@pytest.fixture(scope="module")
def slow_plans() -> tuple[Plan, Plan]:
    cluster = build_cluster(SLOW)
    synchronous = plan_layout(cluster, MODEL, TRAIN, time_budget_s=5)
    synchronous = synchronous.model_copy(update={"predicted": Predicted.model_validate(
        estimate(synchronous, cluster).to_predicted())})
    return synchronous, choose_sync("local", synchronous, cluster, planner(), CostParams())


def test_round_cost_adds_inner_steps_and_the_outer_ring(slow_plans: tuple[Plan, Plan]) -> None:
    cluster, params = build_cluster(SLOW), CostParams()
    _, local = slow_plans
    assert local.outer_sync is not None and len(local.outer_sync.groups) == 2
    used = {d for pipe in local.pipelines for stage in pipe.stages for d in stage.devices}
    assert used == set(cluster.device_ids)  # every device trains
    rounded = round_estimate(local, cluster, params)
    steps = [g.inner_steps for g in local.outer_sync.groups]
    group_s = [estimate(group_plan(local, g), cluster, params).iteration_time_s for g in range(2)]
    assert rounded.inner_s == pytest.approx(max(h * t for h, t in zip(steps, group_s, strict=True)))
    # every pipeline holds the whole model: one bf16 ring of all parameters per holder set, between the nodes
    assert rounded.outer_s > 0 and rounded.round_s == pytest.approx(rounded.inner_s + rounded.outer_s)
    firsts = [local.pipelines[0].stages[0].devices[0], local.pipelines[1].stages[0].devices[0]]
    bandwidth, latency = ring_link(cluster, firsts)
    one_ring = ring_allreduce_seconds(2, total_params(MODEL) * 2, bandwidth, latency)
    assert rounded.outer_s >= one_ring * 0.99  # the holder sets' rings add up to at least one whole model
    assert local.predicted is not None
    assert local.predicted["tokens_per_s"] == pytest.approx(rounded.tokens_per_s, rel=1e-5)


def test_streamed_fragments_hide_the_outer_ring_behind_the_inner_steps(slow_plans: tuple[Plan, Plan]) -> None:
    """F fragments: F exchanges of about 1/F of the bytes each, each overlapped with the inner steps until the
    next one, so the round exposes only what the whole ring exceeds the inner steps by."""
    cluster, params = build_cluster(SLOW), CostParams()
    _, local = slow_plans
    assert local.outer_sync is not None
    whole = round_estimate(local, cluster, params)
    streamed = local.model_copy(update={"outer_sync": local.outer_sync.model_copy(update={"fragments": 4})})
    rounded = round_estimate(streamed, cluster, params)
    assert rounded.outer_bytes == whole.outer_bytes and rounded.outer_s == pytest.approx(whole.outer_s)
    assert rounded.outer_exposed_s == pytest.approx(max(0.0, whole.outer_s - whole.inner_s))
    assert rounded.round_s == pytest.approx(whole.inner_s + rounded.outer_exposed_s)
    assert rounded.round_s <= whole.round_s


def test_local_sync_saves_traffic_and_says_so(slow_plans: tuple[Plan, Plan]) -> None:
    synchronous, local = slow_plans
    assert local.outer_sync is not None and local.outer_sync.reason is not None
    sites = [0] * 4 + [1] * 4
    by_device = {d: i // 4 for i, d in enumerate(build_cluster(SLOW).device_ids)}

    def site_ranks(plan: Plan) -> list[int]:
        return [by_device[d] for pipe in plan.pipelines for stage in pipe.stages for d in stage.devices]

    assert len(sites) == 8
    assert cross_bytes_per_token(local, site_ranks(local)) * 5 < cross_bytes_per_token(synchronous,
                                                                                       site_ranks(synchronous))
    assert "fewer bytes across the slow links" in local.outer_sync.reason
    assert "quality:" in local.outer_sync.reason
    again = choose_sync("local", synchronous, build_cluster(SLOW), planner(), CostParams())
    assert again.to_json() == local.to_json()  # deterministic


def test_auto_stays_synchronous_on_fast_links_and_local_refuses() -> None:
    cluster = build_cluster(FAST)
    synchronous = plan_layout(cluster, MODEL, TRAIN, time_budget_s=5)
    assert choose_sync("auto", synchronous, cluster, planner(), CostParams()) is synchronous
    assert choose_sync("full", synchronous, cluster, planner(), CostParams()) is synchronous
    with pytest.raises(InputError, match="no slow link"):
        choose_sync("local", synchronous, cluster, planner(), CostParams())


def test_cli_bad_sync_options_exit_2(tmp_path: Path) -> None:
    cluster = tmp_path / "c.json"
    cluster.write_text(build_cluster(SLOW).to_json())
    for extra in (["--sync", "sometimes"], ["--inner-steps", "9:3"]):
        done = subprocess.run([FLASHFLEX, "plan", str(cluster), "-m", "llama-tiny", "-b", "4", "-s", "64", *extra],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_cli_local_plan_round_trips(tmp_path: Path) -> None:
    cluster, out = tmp_path / "c.json", tmp_path / "p.json"
    cluster.write_text(build_cluster(SLOW).to_json())
    done = subprocess.run([FLASHFLEX, "plan", str(cluster), "-m", "llama2-7b", "-b", "32", "-s", "1024", "--sync",
                           "local", "--inner-steps", "50:100", "--time-budget", "5", "--jobs", "1", "--no-baseline",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "local sync: 2 replica groups" in done.stdout and "why:" in done.stdout
    plan = Plan.model_validate_json(out.read_text())
    assert plan.outer_sync is not None
    assert all(50 <= g.inner_steps for g in plan.outer_sync.groups)
    assert min(g.inner_steps for g in plan.outer_sync.groups) <= 100
    assert json.loads(out.read_text())["predicted"]["outer_sync"]["round_s"] > 0
    shown = subprocess.run([FLASHFLEX, "show", str(out), "--cluster", str(cluster)], capture_output=True, text=True,
                           timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert "local sync: 2 replica groups" in shown.stdout
    tokens = f"{plan.predicted['tokens_per_s']:,.0f} tokens/s"  # the round's prediction, not one step's
    assert tokens in shown.stdout


def test_int8_pseudo_gradients_cross_the_slow_links_as_an_all_gather() -> None:
    """int8 pseudo-gradients are all-gathered with their scales (an int8 sum would overflow): in a ring of n
    holders each link carries (n - 1) payloads of E + scales bytes for E elements, where bf16's all-reduce carries
    2 (n - 1) / n 2 E: int8 crosses n / 4 of bf16's bytes (plus the scales' 4 / 1024), not the half a 1-byte
    all-reduce would give; past 4 holders more than bf16."""
    cluster = build_cluster("3x4xA100-80G-SXM:nic=eth:bw=1")
    train = TrainConfig(global_batch=48, seq_len=1024)
    synchronous = plan_layout(cluster, MODEL, train, time_budget_s=5)
    synchronous = synchronous.model_copy(update={"predicted": Predicted.model_validate(
        estimate(synchronous, cluster).to_predicted())})
    local = choose_sync("local", synchronous, cluster, planner(), CostParams())
    assert local.outer_sync is not None and len(local.outer_sync.groups) == 3
    node_of = {d: i // 4 for i, d in enumerate(cluster.device_ids)}
    sites = [node_of[d] for pipe in local.pipelines for stage in pipe.stages for d in stage.devices]
    slices = outer_slice_holders(local)
    holders = {len(sl.ranks) for sl in slices if sl.needs_reduce}
    assert len(holders) == 1 and min(holders) >= 3  # one ring size, one holder per pipeline (at least one a group)
    n = holders.pop()
    ratio = cross_bytes(slices, "int8", sites, local) / cross_bytes(slices, "bf16", sites, local)
    assert n / 4 <= ratio <= n / 4 * (1 + 4 / 1024) * 1.01

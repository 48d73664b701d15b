"""The truth in the summary: MFU of every compared layout over the same basis (both labelled), idle devices
as one measured line per node group, dollars in `--json` and `diff`, and old plans still loading."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.cost.estimate import estimate
from flashflex_cli.hardware.cluster import save_cluster
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.diff import diff_plans
from flashflex_cli.plan.render import unused_lines
from flashflex_cli.plan.schema import Plan, TrainConfig
from flashflex_cli.planner.fleet.economics import annotated
from flashflex_cli.planner.fleet.idle_groups import group_idle, with_measured_reasons
from flashflex_cli.planner.fleet.idle_measure import measure_idle
from flashflex_cli.planner.fleet.objective import on_full_cluster, reduced_cluster
from flashflex_cli.planner.search import plan_layout

MFU = re.compile(r"MFU ([0-9.]+)% of the (\d+) devices used, ([0-9.]+)% of all (\d+) devices")


@pytest.fixture(scope="module")
def skewed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A cluster where the plan leaves the 12 GiB cards behind 10 Gbit/s Ethernet idle (llama2-13b)."""
    root = tmp_path_factory.mktemp("truth")
    cluster = root / "cluster.json"
    save_cluster(cluster, build_cluster("1x8xA100-80G-SXM:nic=ib,1x8xRTX-3080Ti:nic=eth:bw=1", name="skewed"))
    prices = root / "prices.json"  # the example's A100 price; the 3080 Ti is rarely rented: a made-up default
    prices.write_text(json.dumps({"schema": "flashflex.prices/1", "default_per_device_hour": 0.3,
                                  "prices": [{"type": "A100-80G-SXM", "per_device_hour": 5.12}]}))
    return {"root": root, "cluster": cluster, "prices": prices}


@pytest.fixture(scope="module")
def planned(skewed: dict[str, Path]) -> tuple[Plan, str]:
    out = skewed["root"] / "plan.json"
    import contextlib
    import io

    err = io.StringIO()  # the summary goes to stdout
    with contextlib.redirect_stdout(err):
        code = main(["plan", str(skewed["cluster"]), "--model", "llama2-13b", "--global-batch", "32", "--seq-len",
                     "4096", "--time-budget", "30", "--prices", str(skewed["prices"]), "--out", str(out)])
    assert code == 0
    return Plan.model_validate(json.loads(out.read_text())), err.getvalue()


def test_the_plan_file_with_its_measured_reasons_is_byte_identical_when_planned_again(
        skewed: dict[str, Path], planned: tuple[Plan, str], capsys: pytest.CaptureFixture[str]) -> None:
    again = skewed["root"] / "again.json"
    assert main(["plan", str(skewed["cluster"]), "--model", "llama2-13b", "--global-batch", "32", "--seq-len", "4096",
                 "--time-budget", "30", "--prices", str(skewed["prices"]), "--no-baseline", "--out", str(again)]) == 0
    assert again.read_bytes() == (skewed["root"] / "plan.json").read_bytes()


def test_every_compared_layout_shows_mfu_over_the_devices_used_and_over_the_whole_cluster(
        planned: tuple[Plan, str]) -> None:
    plan, err = planned
    rows = {}
    for line in err.splitlines():
        name = line.strip().split(":")[0]
        match = MFU.search(line)
        if name in ("flashflex", "uniform") and match:
            tokens = float(line.split(":", 1)[1].split("tokens/s")[0].replace(",", ""))
            rows[name] = (tokens, *map(float, match.groups()))
    assert set(rows) == {"flashflex", "uniform"}
    # the cluster's dense bf16 peak: 8 A100s at 312 TFLOP/s and 8 RTX 3080 Ti at 68.2 (the catalog's figures)
    assert plan.predicted["peak_flops_cluster"] == pytest.approx(8 * 312e12 + 8 * 68.2e12)
    per_device_peak = {8: 312e12}  # both layouts here run on the 8 A100s
    for tokens, used_mfu, used, cluster_mfu, total in rows.values():
        assert total == 16 and used == 8 and tokens > 0
        # over the whole cluster: the same model FLOPs over a larger peak; printed to 0.1 percentage point
        share = used * per_device_peak[used] / plan.predicted["peak_flops_cluster"]
        assert cluster_mfu == pytest.approx(used_mfu * share, abs=0.1)
    # one basis: the layout with more tokens/s has the higher cluster-wide MFU
    (ta, *_, ca, _), (tb, *_, cb, _) = rows["flashflex"], rows["uniform"]
    assert ta < tb or ca >= cb


def test_idle_devices_are_one_measured_line_per_node_group(planned: tuple[Plan, str]) -> None:
    plan, err = planned
    idle = [u for u in plan.unused_devices]
    assert idle and {u.device.split("/")[0] for u in idle} == {"node1"}
    lines = unused_lines(plan)
    assert len(lines) == 1 and lines[0].startswith("unused node1/0-7: using node1 (8 x RTX-3080Ti) ")
    assert sum(line.strip().startswith("unused ") for line in err.splitlines()) == 1
    reason = idle[0].reason
    assert "the fastest plan found leaves it idle" not in reason
    # 8 x 12 GiB cannot hold llama2-13b's weights, gradients and optimizer state: measured, not guessed
    assert "as a pipeline of its own: cannot run (memory: llama2-13b's weights" in reason
    assert re.search(r"as \d+ extra stages? at the (end|front) of pipeline \d+: "
                     r"(-[0-9.]+% tokens/s \((DP|p2p|bubble|optimizer|its gradient)|cannot run \()", reason)
    assert "it costs USD" in reason


def test_a_reason_names_the_link_and_the_exposed_reduction_it_measured() -> None:
    """RTX 4090s behind 10 Gbit/s Ethernet next to InfiniBand A100s: whatever way they join, the gradient
    reduction over the slow NIC dominates, and the figures are the cost model's."""
    cluster = build_cluster("1x8xA100-80G-SXM:nic=ib,1x8xRTX-4090:nic=eth")
    train = TrainConfig(global_batch=32, seq_len=2048)
    plan = plan_layout(reduced_cluster(cluster, ["node0"]), PRESETS["llama2-7b"], train, time_budget_s=30)
    plan = on_full_cluster(plan, cluster, {"node1": "the fastest plan found leaves it idle"})
    groups = measure_idle(plan, cluster)
    assert len(groups) == 1 and groups[0].devices == tuple(f"node1/{i}" for i in range(8))
    line = groups[0].reason
    assert line.startswith("using node1 (8 x RTX-4090) as a pipeline of its own: ")
    found = re.search(r"as \d+ extra stages? at the (?:end|front) of pipeline \d+: (-[0-9.]+)% tokens/s \(its gradient "
                      r"reduction over 10 Gbit/s eth exposes ([0-9.e+-]+) s \(was ([0-9.e+-]+) s\)\)", line)
    assert found, line
    pct, exposed, was = (float(x) for x in found.groups())
    # "was": the plan's own exposed DP time by cost.estimate, to the 3 significant digits printed
    assert was == pytest.approx(estimate(plan, cluster).dp_exposed_s, rel=5e-3)
    assert exposed > 10 * was and pct < -10


def test_identical_idle_nodes_in_a_row_are_one_line() -> None:
    cluster = build_cluster("1x4xA100-80G-SXM:nic=ib,3x4xT4:nic=eth")
    train = TrainConfig(global_batch=16, seq_len=1024)
    plan = plan_layout(reduced_cluster(cluster, ["node0"]), PRESETS["llama-1b"], train, time_budget_s=30)
    plan = on_full_cluster(plan, cluster, {n: "left for this test" for n in ("node1", "node2", "node3")})
    assert [nodes for _, nodes in group_idle(plan, cluster)] == [("node1", "node2", "node3")]
    groups = measure_idle(plan, cluster)
    assert len(groups) == 1 and groups[0].label.startswith("node1..node3 (3 nodes of 4 x T4")
    lines = unused_lines(with_measured_reasons(plan, groups))
    assert len(lines) == 1 and lines[0].startswith("unused node1/0-3,node2/0-3,node3/0-3: using node1..node3")


def test_json_and_diff_carry_dollars_and_the_cluster_basis(skewed: dict[str, Path], planned: tuple[Plan, str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    plan, _ = planned
    money = plan.predicted["dollars"]
    assert money["currency"] == "USD" and len(money["prices_sha256"]) == 64
    assert money["per_hour_used"] == pytest.approx(8 * 5.12)  # the 8 A100s used, example prices
    assert money["per_hour_cluster"] > money["per_hour_used"]
    assert plan.predicted["devices_cluster"] == 16
    uniform = skewed["root"] / "uniform.json"
    capsys.readouterr()
    assert main(["plan", str(skewed["cluster"]), "--model", "llama2-13b", "--global-batch", "32", "--seq-len", "4096",
                 "--strategy", "uniform", "--prices", str(skewed["prices"]), "--out", str(uniform), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["dollars"]["currency"] == "USD"
    assert main(["diff", str(skewed["root"] / "plan.json"), str(uniform), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    for name in ("mfu_cluster", "per_hour_used", "per_hour_cluster", "per_million_tokens_used"):
        assert metrics[name]["a"] is not None and metrics[name]["b"] is not None
    assert metrics["per_hour_cluster"]["delta"] == 0  # the same cluster, the same bill
    # re-priced against the cluster: the same figures
    assert main(["show", str(skewed["root"] / "plan.json"), "--cluster", str(skewed["cluster"]), "--prices",
                 str(skewed["prices"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted"]["dollars"] == money


def test_old_plans_without_the_new_fields_load_and_bad_new_fields_are_refused(
        planned: tuple[Plan, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan, _ = planned
    data = json.loads(plan.to_json())
    for key in ("dollars", "peak_flops_cluster", "devices_cluster"):
        del data["predicted"][key]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["show", str(old)]) == 0
    assert re.search(r"MFU [0-9.]+%, iteration", capsys.readouterr().out)
    assert [m.name for m in diff_plans(Plan.model_validate(data), Plan.model_validate(data)).metrics] == [
        "tokens_per_s", "mfu", "iteration_time_s"]
    data["predicted"]["dollars"] = {"currency": "USD", "per_hour_used": "cheap"}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "predicted.dollars.per_hour_used" in err and err.count("\n") == 1


def test_annotating_is_idempotent_and_needs_no_prices() -> None:
    cluster = build_cluster("1x2xcpu")
    plan = plan_layout(cluster, PRESETS["llama-tiny"], TrainConfig(global_batch=4, seq_len=32, dtype="fp32"))
    once = annotated(plan, cluster)
    assert "dollars" not in once.predicted and once.predicted["devices_cluster"] == 2
    assert annotated(once, cluster) == once

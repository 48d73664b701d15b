"""planner/objective.py through `flashflex plan`: --objective cost leaves expensive, barely faster devices
idle where --objective throughput uses them; --budget; --exclude; --explain; the search's own logic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.hardware.cluster import load_cluster, save_cluster
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan, TrainConfig
from flashflex_cli.planner.fleet import objective
from flashflex_cli.planner.fleet.pricing import load_prices, prices_for
from flashflex_cli.planner.search import plan_layout

# Two nodes of equal peak FLOP/s: the 80 GB A100s are somewhat faster (memory for a layout with less TP, more
# bandwidth for the optimizer step) and cost 20 times as much per hour in this (made-up) prices file.
SPEC = "1x4xA100-40G-SXM:nic=ib:name=cheap,1x4xA100-80G-SXM:nic=ib:name=dear"
PRICES = {"schema": "flashflex.prices/1", "currency": "USD", "prices": [
    {"type": "A100-40G-SXM", "per_device_hour": 1.0}, {"type": "A100-80G-SXM", "per_device_hour": 20.0}]}
ARGS = ["--model", "llama-1b", "--global-batch", "32", "--seq-len", "1024", "--time-budget", "30"]
DEAR = {f"dear0/{i}" for i in range(4)}
CHEAP = {f"cheap0/{i}" for i in range(4)}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("objective")
    cluster, prices = root / "cluster.json", root / "prices.json"
    save_cluster(cluster, build_cluster(SPEC, name="two-kinds"))
    prices.write_text(json.dumps(PRICES))
    return {"root": root, "cluster": cluster, "prices": prices}


def _plan(files: dict[str, Path], name: str, *options: str) -> tuple[Plan, str]:
    out = files["root"] / f"{name}.json"
    code = main(["plan", str(files["cluster"]), *ARGS, "--prices", str(files["prices"]), "--no-baseline",
                 "--out", str(out), *options])
    assert code == 0
    return Plan.model_validate(json.loads(out.read_text())), out.name


@pytest.fixture(scope="module")
def plans(files: dict[str, Path]) -> dict[str, Plan]:
    return {name: _plan(files, name, *opts)[0] for name, opts in (
        ("throughput", ["--objective", "throughput"]), ("cost", ["--objective", "cost"]),
        ("budget", ["--budget", "10"]))}


def _used(plan: Plan) -> set[str]:
    return {r.device for r in plan.ranks()}


def test_cost_objective_leaves_the_expensive_barely_faster_devices_idle(plans: dict[str, Plan]) -> None:
    fast, cheap = plans["throughput"], plans["cost"]
    assert DEAR <= _used(fast)  # the throughput objective uses the expensive devices
    assert not DEAR & _used(cheap) and _used(cheap) <= CHEAP
    reasons = {u.device: u.reason for u in cheap.unused_devices}
    assert all(reasons[d].startswith("left out by --objective cost: the plan without it: ") for d in DEAR)
    assert "the best plan found with it: " in reasons["dear0/0"]
    a, b = fast.predicted["dollars"], cheap.predicted["dollars"]
    assert fast.predicted["tokens_per_s"] > cheap.predicted["tokens_per_s"]
    assert b["per_million_tokens_used"] < a["per_million_tokens_used"]
    assert b["per_hour_used"] == pytest.approx(len(_used(cheap)) * 1.0)
    assert a["per_hour_cluster"] == b["per_hour_cluster"] == pytest.approx(84.0)  # 4 x 1 + 4 x 20
    # $ per million tokens is what the formula says: per hour / (tokens/s x 3600) x 1e6 (6 significant digits)
    expected = b["per_hour_used"] / (cheap.predicted["tokens_per_s"] * 3600) * 1e6
    assert b["per_million_tokens_used"] == pytest.approx(expected, rel=1e-5)


def test_the_expensive_devices_are_only_barely_faster(files: dict[str, Path]) -> None:
    cluster = load_cluster(files["cluster"])
    train = TrainConfig(global_batch=32, seq_len=1024)
    alone = {}
    for keep in ("cheap0", "dear0"):
        plan = plan_layout(objective.reduced_cluster(cluster, [keep]), PRESETS["llama-1b"], train, time_budget_s=30)
        alone[keep] = plan.predicted["tokens_per_s"]
    # faster (twice the memory allows a layout with less TP), but far from 20 times: at most 1.5 times
    assert alone["cheap0"] < alone["dear0"] <= 1.5 * alone["cheap0"]


def test_a_budget_gives_the_most_throughput_within_it(files: dict[str, Path], plans: dict[str, Plan],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    within = plans["budget"]
    assert within.predicted["dollars"]["per_hour_used"] <= 10.0
    assert _used(within) == CHEAP  # the dear node alone (80 $/h) is over the budget
    capsys.readouterr()
    out = files["root"] / "never.json"
    code = main(["plan", str(files["cluster"]), *ARGS, "--prices", str(files["prices"]), "--budget", "0.5",
                 "--no-baseline", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "no plan found within --budget 0.5/h" in err and err.count("\n") == 1
    assert not out.exists()


def test_exclude_plans_without_the_nodes_and_the_plan_still_fits_the_whole_cluster(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    plan, name = _plan(files, "excluded", "--exclude", "dear0")
    assert not DEAR & _used(plan)
    assert {u.device: u.reason for u in plan.unused_devices if u.device in DEAR} == {
        d: "excluded with --exclude" for d in DEAR}
    capsys.readouterr()
    assert main(["show", str(files["root"] / name), "--cluster", str(files["cluster"])]) == 0
    assert "warning" not in capsys.readouterr().err  # same cluster hash, every device listed


def test_explain_prints_what_each_node_group_adds_and_whether_it_pays(files: dict[str, Path],
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    _plan(files, "explained", "--explain")
    out = capsys.readouterr().out
    lines = {line.strip().split(" ")[0]: line for line in out.splitlines() if "/M tokens with it" in line}
    assert "does not pay for itself" in lines["dear0"] and "(4 x A100-80G-SXM), USD 80.00/h: adds" in lines["dear0"]
    assert "pays for itself" in lines["cheap0"] and "does not" not in lines["cheap0"]


def test_greedy_elimination_finds_what_the_exhaustive_search_finds(files: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = load_cluster(files["cluster"])
    prices = prices_for(load_prices(files["prices"])[0], cluster)
    calls = []

    def fake(sub: object) -> Plan:  # the greedy pass below must find every plan it needs memoised
        raise AssertionError("re-planned a reduced cluster that was already planned")

    search = objective.Search(cluster, fake, prices)
    train = TrainConfig(global_batch=32, seq_len=1024)

    def real(sub: object) -> Plan:
        calls.append(sub)
        return plan_layout(sub, PRESETS["llama-1b"], train, time_budget_s=30)  # type: ignore[arg-type]

    search.plan_fn = real
    exhaustive = objective.choose(search, ["cheap0", "dear0"], "cost")
    assert exhaustive.best.kept == ("cheap0",) and len(calls) == 3  # every non-empty reduced cluster once
    monkeypatch.setattr(objective, "EXHAUSTIVE_LIMIT", 0)
    search.plan_fn = fake  # greedy re-uses the memoised plans: the same answer, no planning
    greedy = objective.choose(search, ["cheap0", "dear0"], "cost")
    assert greedy.best.kept == exhaustive.best.kept and greedy.method.startswith("greedy elimination")


def test_a_group_whose_removal_is_faster_says_the_search_missed_it(plans: dict[str, Plan]) -> None:
    plan = plans["cost"]
    slow = objective.Trial(("cheap0", "dear0"), plan, tokens_per_s=100.0, per_hour=84.0)
    fast = objective.Trial(("cheap0",), plan, tokens_per_s=150.0, per_hour=4.0)
    row = objective.Marginal("dear0 (4 x A100-80G-SXM)", ("dear0",), slow, fast, per_hour=80.0)
    line = objective.marginal_line(row, "USD")
    assert line.startswith("dear0 (4 x A100-80G-SXM), USD 80.00/h: the plan without it is faster by 50 tokens/s "
                           "(33.3%): the search missed it (plan with --exclude dear0")
    # 84 $/h at 100 tokens/s = 233.3 $/M tokens; 4 $/h at 150 tokens/s = 7.407 $/M tokens
    assert line.endswith("USD 233.3/M tokens with it, 7.407 without: does not pay for itself")

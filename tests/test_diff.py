"""plan/diff.py: structural changes and metric deltas between two plans."""

from __future__ import annotations

import pytest

from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.diff import diff_plans
from flashflex_cli.plan.schema import Plan, TrainConfig
from flashflex_cli.planner.search import plan_layout


@pytest.fixture(scope="module")
def plans() -> tuple[Plan, Plan]:
    cluster = build_cluster("1x4xcpu:slowdown=1,1,2,2")
    train = TrainConfig(global_batch=16, seq_len=128, dtype="fp32")
    ours = plan_layout(cluster, PRESETS["llama-small"], train, time_budget_s=30)
    base = plan_layout(cluster, PRESETS["llama-small"], train, strategy="uniform")
    return ours, base


def test_identical_plans_have_no_changes(plans: tuple[Plan, Plan]) -> None:
    ours, _ = plans
    result = diff_plans(ours, ours)
    assert result.changes == []
    assert result.regression_pct() == 0.0
    assert result.to_json()["identical"] is True


def test_structural_changes_and_metric_deltas(plans: tuple[Plan, Plan]) -> None:
    ours, base = plans
    result = diff_plans(ours, base)
    assert "strategy: flashflex -> uniform" in result.changes
    assert any(line.startswith("pipeline 0") for line in result.changes)
    tps = result.metric("tokens_per_s")
    assert tps.a == ours.predicted["tokens_per_s"] and tps.b == base.predicted["tokens_per_s"]
    assert tps.pct == pytest.approx((tps.b - tps.a) / tps.a * 100)
    assert result.regression_pct() == pytest.approx(-tps.pct)
    assert result.regression_pct() > 0  # uniform is slower on this skewed cluster


def test_micro_batch_and_layer_edits_are_listed(plans: tuple[Plan, Plan]) -> None:
    ours, _ = plans
    data = ours.model_dump(mode="json", by_alias=True)
    data["pipelines"][0]["num_micro_batches"] += 1
    data["pipelines"][1]["num_micro_batches"] -= 1
    edited = Plan.model_validate(data)
    lines = diff_plans(ours, edited).changes
    old, new = ours.pipelines[0].num_micro_batches, edited.pipelines[0].num_micro_batches
    assert f"pipeline 0: micro-batches {old}x1 -> {new}x1" in lines
    assert len(lines) == 2

"""Plan format of low-communication training (issue 32, item 1): replica groups, the round schedule, show/diff."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from rich.console import Console

from flashflex_cli.plan.diff import diff_plans
from flashflex_cli.plan.render import render_plan
from flashflex_cli.plan.schema import Plan, load_plan
from flashflex_cli.semantics.outer_sync import (
    group_ranks,
    group_weights,
    round_rows,
    round_sequences,
)
from tests.test_parity import make_plan

REPO = Path(__file__).resolve().parents[1]


def grouped_plan(outer: dict[str, Any] | None = None) -> Plan:
    """Three pipelines (2, 1 and 2 sequences per step); groups [0, 1] (4 inner steps) and [2] (3 inner steps)."""
    base = make_plan("llama-tiny", [(1, 2, [(1, (0, 4))]), (1, 1, [(2, (0, 1)), (1, (1, 4))]),
                                    (2, 1, [(1, (0, 4))])])
    data = json.loads(base.to_json())
    data["outer_sync"] = outer or {"groups": [{"pipelines": [0, 1], "inner_steps": 4},
                                              {"pipelines": [2], "inner_steps": 3}]}
    return Plan.model_validate(data)


def test_old_plans_load_unchanged_and_rewrite_byte_identical() -> None:
    for path in sorted((REPO / "plans").glob("*.json")):
        plan = load_plan(path)
        assert plan.outer_sync is None
        assert plan.to_json() == path.read_text()


def test_grouped_plan_round_trips_with_defaults() -> None:
    plan = grouped_plan()
    outer = plan.outer_sync
    assert outer is not None
    assert (outer.optimizer.lr, outer.optimizer.momentum, outer.optimizer.nesterov) == (0.7, 0.9, True)
    assert (outer.compression, outer.fragments) == ("bf16", 1)
    again = Plan.model_validate_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()


def test_round_schedule_weights_and_rows() -> None:
    plan = grouped_plan()
    # group 0: 3 sequences x 4 steps = 12; group 1: 2 x 3 = 6
    assert round_sequences(plan) == 18
    assert group_weights(plan) == pytest.approx([12 / 18, 6 / 18])
    assert group_ranks(plan) == [(0, 1, 2, 3), (4,)]
    seen: set[int] = set()
    for pipeline, steps in ((0, 4), (1, 4), (2, 3)):
        for k in range(steps):
            rows = round_rows(plan, pipeline, 5, k)
            assert rows.round == 5
            assert rows.stop - rows.start == plan.pipelines[pipeline].sequences
            got = set(range(rows.start, rows.stop))
            assert not got & seen
            seen |= got
    assert seen == set(range(18))  # a round reads every row of its batch once


@pytest.mark.parametrize(("outer", "words"), [
    ({"groups": [{"pipelines": [1, 0], "inner_steps": 2}, {"pipelines": [2], "inner_steps": 2}]}, "consecutive"),
    ({"groups": [{"pipelines": [0, 1], "inner_steps": 2}]}, "cover 2 pipelines"),
    ({"groups": [{"pipelines": [0, 1, 2], "inner_steps": 0}]}, "inner_steps"),
    ({"groups": [{"pipelines": [0, 1, 2], "inner_steps": 2}], "compression": "fp8"}, "compression"),
    ({"groups": [{"pipelines": [0, 1, 2], "inner_steps": 2}], "optimizer": {"lr": -1}}, "lr"),
    ({"groups": [{"pipelines": [0, 1, 2], "inner_steps": 2}], "fragments": 5}, "fragments"),
    ({"groups": []}, "groups"),
])
def test_bad_groups_are_refused(outer: dict[str, Any], words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        grouped_plan(outer)


def test_show_and_diff_render_the_groups() -> None:
    plan = grouped_plan()
    out = io.StringIO()
    render_plan(Console(file=out, width=200), plan)
    text = out.getvalue()
    assert "local sync: 2 replica groups" in text
    assert "outer SGD, Nesterov momentum 0.9, lr 0.7" in text and "pseudo-gradients in bf16" in text
    assert "group 0: pipelines 0-1, 4 inner steps per round" in text and "66.7% of the round's tokens" in text
    assert "group 1: pipeline 2, 3 inner steps" in text
    data = json.loads(plan.to_json())
    synchronous = Plan.model_validate({k: v for k, v in data.items() if k != "outer_sync"})
    assert "sync: synchronous -> 2 replica groups" in diff_plans(synchronous, plan).changes
    data["outer_sync"]["groups"][1]["inner_steps"] = 5
    data["outer_sync"]["compression"] = "int8"
    changed = Plan.model_validate(data)
    changes = diff_plans(plan, changed).changes
    assert "group 1: inner steps per round 3 -> 5" in changes
    assert any(line.startswith("outer sync: pseudo-gradients in bf16") and "int8" in line for line in changes)
    assert diff_plans(plan, plan).changes == []

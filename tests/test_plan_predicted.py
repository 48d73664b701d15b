"""A plan's `predicted` block as typed models (plan/predicted.py): committed plans re-written byte for byte, figures
keep their JSON type, absent fields stay absent, null dollars stay null, bad figures refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from flashflex_cli.errors import InputError
from flashflex_cli.plan.predicted import Predicted, PredictedDollars
from flashflex_cli.plan.schema import Plan, load_plan

PLANS = sorted((Path(__file__).parent.parent / "plans").glob("*.json"))


@pytest.mark.parametrize("path", PLANS, ids=[p.name for p in PLANS])
def test_a_committed_plan_is_rewritten_byte_for_byte(path: Path) -> None:
    plan = load_plan(path)
    assert isinstance(plan.predicted, Predicted) and plan.predicted.stages
    assert plan.to_json() == path.read_text()


def test_figures_keep_their_json_type_and_absent_fields_stay_absent() -> None:
    given = {"iteration_time_s": 1, "tokens_per_s": 256.0, "mfu": 0.5,
             "pipelines": [{"time_s": 1.0, "bubble_fraction": 0.0, "tokens": 768}],
             "stages": [{"pipeline": 0, "stage": 0, "time_s": 0.5}],
             "dollars": {"currency": "USD", "per_hour_used": None, "per_hour_cluster": 2.5}}
    predicted = Predicted.model_validate(given)
    assert predicted.fits_memory and predicted.stages[0].source is None  # type: ignore[index]
    assert predicted.model_dump(mode="json", exclude_none=True) == given
    assert json.dumps(predicted.model_dump(mode="json", exclude_none=True)) == json.dumps(given)
    assert PredictedDollars.model_validate({"per_hour_used": None}).model_dump() == {"per_hour_used": None}


@pytest.mark.parametrize(("change", "where"), [
    ({"mfu": "0.5"}, "mfu"), ({"mfu": True}, "mfu"), ({"tokens_per_s": -1.0}, "tokens_per_s"),
    ({"iteration_time_s": float("inf")}, "iteration_time_s"), ({"fits": "yes"}, "fits"),
    ({"stages": [{"pipeline": 0, "stage": 0, "memory_bytes": -1}]}, "stages.0.memory_bytes"),
    ({"stages": [{"pipeline": "0", "stage": 0}]}, "stages.0.pipeline"),
    ({"surprise": 1}, "surprise"),
])
def test_a_bad_figure_is_refused_by_name(change: dict[str, object], where: str) -> None:
    with pytest.raises(ValidationError) as exc:
        Predicted.model_validate({"iteration_time_s": 1.0, "tokens_per_s": 1.0, "mfu": 0.1, **change})
    assert ".".join(str(part) for part in exc.value.errors()[0]["loc"]) == where


def test_a_plan_holds_the_typed_block() -> None:
    plan = load_plan(PLANS[0])
    data = json.loads(plan.to_json())
    data["predicted"]["mfu"] = 0.25
    assert Plan.model_validate(data).predicted.mfu == 0.25  # type: ignore[union-attr]


def test_the_typed_block_reads_as_the_json_object_it_holds() -> None:
    plan = load_plan(PLANS[0])
    predicted = plan.predicted
    assert predicted is not None
    data = json.loads(plan.to_json())["predicted"]
    assert list(predicted) == list(predicted.keys()) == list(data) and len(predicted) == len(data)
    assert predicted["tokens_per_s"] == predicted.tokens_per_s and predicted.get("nothing", 3) == 3
    assert "dollars" not in predicted and predicted.get("dollars") is None
    with pytest.raises(KeyError):
        predicted["dollars"]
    stage = predicted["stages"][0]
    assert set(stage) == set(data["stages"][0]) and stage["pipeline"] == 0
    assert "dtype_not_native_on" not in stage
    assert predicted == data and data == predicted and predicted != {**data, "mfu": 0.0}
    changed = plan.model_copy(update={"predicted": {**predicted, "mfu": 0.25}})
    assert isinstance(changed.predicted, Predicted) and changed.predicted.mfu == 0.25
    dollars = PredictedDollars.model_validate({"currency": "USD", "per_hour_used": None})
    assert dict(dollars.items()) == {"currency": "USD", "per_hour_used": None}


@pytest.mark.parametrize(("change", "message"), [
    ({"mfu": "0.5"}, "predicted.mfu must be a number, got '0.5'"),
    ({"fits": "yes"}, "predicted.fits must be a bool, got 'yes'"),
    ({"stages": [{"pipeline": "0", "stage": 0}]}, "predicted.stages.0.pipeline must be an integer, got '0'"),
    ({"stages": [{"pipeline": 0, "stage": 0, "dtype_not_native_on": "V100-16G"}]},
     "predicted.stages.0.dtype_not_native_on must be a list, got 'V100-16G'"),
    ({"problems": "boom"}, "predicted.problems must be a list, got 'boom'"),
    ({"tokens_per_s": float("nan")}, "predicted.tokens_per_s must be a finite number, got nan"),
])
def test_a_plan_names_a_refused_figure_in_one_line(tmp_path: Path, change: dict[str, object], message: str) -> None:
    data = json.loads(PLANS[0].read_text())
    data["predicted"] = {**data["predicted"], **change}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as exc:
        load_plan(path)
    assert str(exc.value) == f"{path}: {message}"

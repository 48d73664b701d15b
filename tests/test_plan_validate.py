"""plan/validate.py: a plan checked against a cluster and re-estimated."""

from __future__ import annotations

from flashflex_cli.cost.reestimate import reestimated, validate_plan
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan, TrainConfig
from flashflex_cli.planner.search import plan_layout

SPEC = "1x4xcpu:slowdown=1,1,2,2"


def _plan() -> Plan:
    return plan_layout(build_cluster(SPEC, name="demo"), PRESETS["llama-small"],
                       TrainConfig(global_batch=16, seq_len=128, dtype="fp32"), time_budget_s=30)


def _edit(plan: Plan, **changes: object) -> Plan:
    data = plan.model_dump(mode="json", by_alias=True)
    data.update(changes)
    return Plan.model_validate(data)


def test_a_plan_validates_on_its_own_cluster_and_reestimates_to_the_same_figures() -> None:
    plan = _plan()
    result = validate_plan(plan, build_cluster(SPEC, name="demo"))
    assert result.ok and result.warnings == []
    assert reestimated(plan, result.estimate).predicted == plan.predicted


def test_unknown_devices_are_errors_and_a_different_cluster_is_a_warning() -> None:
    plan = _plan()
    small = validate_plan(plan, build_cluster("1x2xcpu", name="small"))
    assert not small.ok and small.estimate is None
    assert "does not have: node0/2, node0/3" in small.errors[0]
    other = validate_plan(plan, build_cluster("1x4xcpu:slowdown=1,1,1,1", name="other"))
    assert other.ok and other.estimate is not None
    assert any("was made for cluster demo" in w for w in other.warnings)
    # the slowed devices are now full speed: the pipeline on them gets faster, the whole never slower (whether
    # the iteration falls depends on which pipeline bounds it)
    again = reestimated(plan, other.estimate).predicted
    slow = next(i for i, pipe in enumerate(plan.pipelines) if "node0/2" in pipe.stages[0].devices)
    assert again["pipelines"][slow]["time_s"] < plan.predicted["pipelines"][slow]["time_s"]
    assert again["tokens_per_s"] >= plan.predicted["tokens_per_s"]


def test_memory_over_capacity_names_the_device_and_the_bytes() -> None:
    plan = plan_layout(build_cluster("1x4xA100-80G-SXM:nic=ib"), PRESETS["llama2-7b"],
                       TrainConfig(global_batch=16, seq_len=2048), time_budget_s=30)
    # hand-edit: every layer on one device in one pipeline
    data = plan.model_dump(mode="json", by_alias=True)
    first = data["pipelines"][0]
    first["stages"] = [{"devices": ["node0/0"], "tp": 1, "layers": [0, 32]}]
    first["num_micro_batches"] = 16
    data["pipelines"] = [first]
    data["unused_devices"] = [{"device": f"node0/{i}", "reason": "hand edit"} for i in (1, 2, 3)]
    edited = Plan.model_validate(data)
    result = validate_plan(edited, build_cluster("1x4xA100-80G-SXM:nic=ib"))
    assert not result.ok
    assert any("out of memory: pipelines.0.stages.0: needs" in e and "node0/0 allows" in e for e in result.errors)


def test_devices_neither_used_nor_listed_are_reported() -> None:
    plan = _plan()
    cluster = build_cluster("1x6xcpu:slowdown=1,1,2,2,1,1", name="demo")
    result = validate_plan(plan, cluster)
    assert any("neither used nor listed as unused: node0/4, node0/5" in w for w in result.warnings)


def test_a_plan_written_with_the_old_train_micro_batch_size_loads_and_says_it_once() -> None:
    """Before the pipelines were the micro-batch size's only home, `inputs.train` carried the planner's base size:
    such a plan loads to the same plan (the pipelines' sizes unchanged) and writes without the old key."""
    plan = _plan()
    data = plan.model_dump(mode="json", by_alias=True)
    data["inputs"]["train"]["micro_batch_size"] = 1
    old = Plan.model_validate(data)
    assert old == plan and old.to_json() == plan.to_json()
    assert "micro_batch_size" not in old.inputs.train.model_dump()
    assert [p.micro_batch_size for p in old.pipelines] == [p.micro_batch_size for p in plan.pipelines]


def test_an_impossible_old_train_micro_batch_size_is_refused_by_name() -> None:
    data = _plan().model_dump(mode="json", by_alias=True)
    for bad in (0, -3, "4", 2.5, True):
        data["inputs"]["train"]["micro_batch_size"] = bad
        try:
            Plan.model_validate(data)
        except ValueError as exc:
            assert "micro_batch_size" in str(exc)
        else:
            raise AssertionError(f"micro_batch_size {bad!r} was accepted")

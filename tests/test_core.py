"""Core contracts: atomic JSON I/O, plan schema validation, model specs, CLI error handling."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.errors import InputError
from flashflex_cli.fileio import atomic_write_text, load_model, read_json
from flashflex_cli.model.hf_config import resolve_model
from flashflex_cli.model.spec import PRESETS, ModelSpec
from flashflex_cli.plan.schema import PLAN_SCHEMA, Plan, load_plan

TINY = PRESETS["llama-tiny"].model_dump()


def _plan_dict(**overrides: object) -> dict:
    plan = {
        "schema": PLAN_SCHEMA,
        "inputs": {"cluster_sha256": "x", "model": TINY,
                   "train": {"global_batch": 6, "seq_len": 16, "micro_batch_size": 1, "dtype": "fp32"}},
        "pipelines": [
            {"micro_batch_size": 1, "num_micro_batches": 2,
             "stages": [{"devices": ["n/0", "n/1"], "tp": 2, "layers": [0, 4]}]},
            {"micro_batch_size": 1, "num_micro_batches": 4,
             "stages": [{"devices": ["n/2"], "tp": 1, "layers": [0, 1]},
                        {"devices": ["n/3"], "tp": 1, "layers": [1, 4]}]},
        ],
    }
    plan.update(overrides)
    return plan


def test_atomic_write_leaves_no_partial_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "out.json"
    atomic_write_text(target, "old")

    def boom(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(InputError, match=r"cannot write .*out\.json: disk full"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_read_json_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match=r"malformed JSON at line 1"):
        read_json(bad)
    with pytest.raises(InputError, match="no such file"):
        read_json(tmp_path / "missing.json")


def test_plan_ranks_follow_pipelines_stages_devices() -> None:
    plan = Plan.model_validate(_plan_dict())
    assert [(r.rank, r.pipeline, r.stage, r.tp_rank, r.device) for r in plan.ranks()] == [
        (0, 0, 0, 0, "n/0"), (1, 0, 0, 1, "n/1"), (2, 1, 0, 0, "n/2"), (3, 1, 1, 0, "n/3")]
    assert plan.world_size == 4


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p["pipelines"][1]["stages"][1].update(layers=[2, 4]), "layers start at 2, expected 1"),
        (lambda p: p["pipelines"][1]["stages"][1].update(devices=["n/0"]), "device n/0 is used twice"),
        (lambda p: p["pipelines"][0].update(num_micro_batches=3), "process 7 sequences per step"),
        (lambda p: p["pipelines"][0]["stages"][0].update(tp=3), "tp 3 does not match 2 devices"),
        (lambda p: p["pipelines"][1]["stages"][1].update(layers=[1, 1]), "empty layer range"),
        (lambda p: p["pipelines"][1]["stages"][1].update(layers=[1, 3]), "cover layers \\[0, 3\\)"),
    ],
)
def test_plan_validation_rejects_degenerate_plans(tmp_path: Path, mutate, message: str) -> None:
    data = _plan_dict()
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match=message):
        load_plan(path)


def test_fewer_micro_batches_than_stages_is_a_valid_plan(tmp_path: Path) -> None:
    data = _plan_dict()
    data["pipelines"][1]["num_micro_batches"] = 1  # 2 stages, 1 micro-batch: 1F1B degenerates to F, F, B, B
    data["pipelines"][0]["num_micro_batches"] += data["pipelines"][1]["micro_batch_size"]
    data["inputs"]["train"]["global_batch"] = sum(p["micro_batch_size"] * p["num_micro_batches"]
                                                  for p in data["pipelines"])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert load_plan(path).pipelines[1].num_micro_batches == 1


def test_gqa_plan_needs_kv_heads_divisible_by_tp(tmp_path: Path) -> None:
    data = _plan_dict()
    data["inputs"]["model"] = PRESETS["llama-tiny-gqa"].model_dump()  # 4 heads, 2 kv heads
    data["pipelines"] = [{"micro_batch_size": 1, "num_micro_batches": 6,
                          "stages": [{"devices": ["n/0", "n/1", "n/2", "n/3"], "tp": 4, "layers": [0, 4]}]}]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="num_kv_heads 2"):
        load_plan(path)


def test_plan_json_is_byte_stable(tmp_path: Path) -> None:
    plan = Plan.model_validate(_plan_dict())
    again = Plan.model_validate(json.loads(plan.to_json()))
    assert again.to_json() == plan.to_json()
    assert plan.to_json().endswith("}\n")


def test_unknown_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_plan_dict(schema="flashflex.plan/9")))
    with pytest.raises(InputError, match="unknown schema 'flashflex.plan/9'"):
        load_model(path, Plan, PLAN_SCHEMA)


def test_hf_config_is_read(tmp_path: Path) -> None:
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = resolve_model(str(path))
    assert spec.num_kv_heads == 8 and spec.head_dim == 128
    assert spec.model_dump(exclude={"name"}) == PRESETS["llama3-8b"].model_dump(exclude={"name"})


def test_model_spec_rejects_bad_heads() -> None:
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        ModelSpec(name="x", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=3, intermediate_size=8,
                  vocab_size=10)


def test_cli_reports_bad_input_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    code = main(["show", str(tmp_path / "nope.json")])
    assert main(["no-such-command"]) == 2
    capsys.readouterr()
    code = main(["show", str(tmp_path / "nope.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "no such file" in err[0]

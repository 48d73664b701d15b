"""`flashflex plan / show / diff` end to end (in-process), including bad input and exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.hardware.cluster import save_cluster
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.plan.schema import Plan

PLAN_ARGS = ["--model", "llama-small", "--global-batch", "16", "--seq-len", "128", "--dtype", "fp32",
             "--time-budget", "30"]


@pytest.fixture
def cluster_file(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.json"
    save_cluster(path, build_cluster("1x4xcpu:slowdown=1,1,2,2", name="demo"))
    return path


def test_plan_writes_the_file_prints_json_and_a_summary(cluster_file: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", str(cluster_file), *PLAN_ARGS, "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out == out.read_text()  # --json: the plan alone on stdout
    plan = Plan.model_validate(json.loads(captured.out))
    assert plan.inputs.cluster_name == "demo" and plan.predicted["fits"]
    assert "tokens/s" in captured.err and "uniform" in captured.err and "ratio flashflex / uniform" in captured.err
    assert "pipe" in captured.err and "memory GiB" in captured.err


def test_show_and_show_with_cluster(cluster_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", str(cluster_file), *PLAN_ARGS, "--out", str(out), "--no-baseline"]) == 0
    capsys.readouterr()
    assert main(["show", str(out)]) == 0
    assert "predicted:" in capsys.readouterr().out
    assert main(["show", str(out), "--cluster", str(cluster_file), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(out.read_text())  # fresh estimate, same figures
    # a hand edit: put every layer of pipeline 0 on its first stage's devices -> re-estimated, different figures
    data = json.loads(out.read_text())
    data["pipelines"][0]["num_micro_batches"] += 1
    data["pipelines"][1]["num_micro_batches"] -= 1
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    assert main(["show", str(edited), "--cluster", str(cluster_file), "--json"]) == 0
    fresh = json.loads(capsys.readouterr().out)
    assert fresh["predicted"]["iteration_time_s"] != data["predicted"]["iteration_time_s"]


def test_show_fails_with_exit_1_when_the_plan_does_not_fit(cluster_file: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", str(cluster_file), *PLAN_ARGS, "--out", str(out), "--no-baseline"]) == 0
    tiny = tmp_path / "tiny.json"
    data = build_cluster("1x4xcpu", name="tiny").model_dump(mode="json", by_alias=True)
    for device in data["nodes"][0]["devices"]:
        device["memory_bytes"] = 48 * 1024**2
    tiny.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["show", str(out), "--cluster", str(tiny)]) == 1
    err = capsys.readouterr().err
    assert "error: " in err and "out of memory" in err and "Traceback" not in err


def test_diff_and_fail_on_regression(cluster_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ours, base = tmp_path / "ours.json", tmp_path / "base.json"
    assert main(["plan", str(cluster_file), *PLAN_ARGS, "--out", str(ours), "--no-baseline"]) == 0
    assert main(["plan", str(cluster_file), *PLAN_ARGS, "--strategy", "uniform", "--out", str(base)]) == 0
    capsys.readouterr()
    assert main(["diff", str(ours), str(ours), "--fail-on-regression", "0"]) == 0
    assert main(["diff", str(base), str(ours), "--fail-on-regression", "0"]) == 0  # an improvement passes
    assert "diff " in capsys.readouterr().out  # the human diff on stdout
    assert main(["diff", str(ours), str(base), "--fail-on-regression", "5", "--json"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["metrics"]["tokens_per_s"]["pct"] < -5
    assert "predicted tokens/s fell" in captured.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "llama-nope", "--global-batch", "16", "--seq-len", "128"], "unknown model 'llama-nope'"),
        (["--model", "llama-small", "--global-batch", "15", "--seq-len", "128", "--micro-batch", "2"],
         "global batch 15 is not a multiple of micro-batch size 2"),
        (["--model", "llama2-70b", "--global-batch", "16", "--seq-len", "128"], "llama2-70b needs at least"),
        (["--model", "llama-small", "--global-batch", "16", "--seq-len", "128", "--strategy", "best"],
         "unknown strategy 'best'"),
        (["--model", "llama-small", "--global-batch", "0", "--seq-len", "128"], "--global-batch must be"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_and_writes_nothing(cluster_file: Path, tmp_path: Path, args: list[str],
                                                             message: str, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", str(cluster_file), *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("error: ") and "\n" not in err
    assert not out.exists() and list(tmp_path.glob(".plan.json*")) == []


def test_bad_files_exit_2(tmp_path: Path, cluster_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert main(["show", str(broken)]) == 2
    assert main(["plan", str(tmp_path / "missing.json"), *PLAN_ARGS]) == 2
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "flashflex.plan/9"}))
    assert main(["diff", str(wrong), str(wrong)]) == 2
    err = capsys.readouterr().err
    assert "malformed JSON" in err and "no such file" in err and "unknown schema" in err
    big = tmp_path / "big.json"
    save_cluster(big, build_cluster("2x8xcpu"))
    assert main(["plan", str(big), *PLAN_ARGS, "--strategy", "exhaustive"]) == 2
    assert "at most 12 devices" in capsys.readouterr().err


def test_cost_params_file_overrides_the_cost_model(cluster_file: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    base, slow = tmp_path / "base.json", tmp_path / "slow.json"
    assert main(["plan", str(cluster_file), *PLAN_ARGS, "--out", str(base), "--no-baseline"]) == 0
    overrides = tmp_path / "params.json"
    overrides.write_text(json.dumps({"measured_compute_efficiency": 0.35, "default_compute_efficiency": 0.1}))
    assert main(["plan", str(cluster_file), *PLAN_ARGS, "--out", str(slow), "--no-baseline",
                 "--cost-params", str(overrides)]) == 0
    a = json.loads(base.read_text())["predicted"]["tokens_per_s"]
    b = json.loads(slow.read_text())["predicted"]["tokens_per_s"]
    assert b < a
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"no_such_factor": 1.0}))
    capsys.readouterr()
    assert main(["plan", str(cluster_file), *PLAN_ARGS, "--cost-params", str(bad)]) == 2
    assert "no_such_factor" in capsys.readouterr().err

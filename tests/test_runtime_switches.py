"""The comparison switches (`--no-lean-p2p --no-overlap-dp --no-hierarchical-dp --no-chunked-loss`,
`--compile/--no-compile`, `--optimizer`) reach every worker through the run configuration (RUN/config.json): the
launch saves them there, rendered torchrun and SLURM scripts and a local launch start every worker with that
file only, the worker runs with what it holds, and runtime.json records what ran. The workers get the CUDA
allocator's expandable segments unless the user set PYTORCH_CUDA_ALLOC_CONF."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.launch.local import LocalJob, run_job, worker_env
from flashflex_cli.launch.options import launch_config, worker_argv
from flashflex_cli.launch.slurm import SlurmSettings, render_slurm
from flashflex_cli.launch.torchrun import ElasticRender, RenderSettings, command_lines, render_torchrun
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.run_config import RunConfig, load_run_config, save_run_config
from flashflex_cli.runtime.training.worker import parse_args
from flashflex_cli.semantics.runtime_paths import RuntimeOptions

GOLDEN = Path(__file__).parent / "golden"
PLAN = load_plan(GOLDEN / "plan-4rank.json")
CLUSTER = load_cluster(GOLDEN / "cluster-2node.json")
SWITCHES = {"lean_p2p": "--no-lean-p2p", "overlap_dp": "--no-overlap-dp", "hierarchical_dp": "--no-hierarchical-dp",
            "chunked_loss": "--no-chunked-loss"}
BASE = launch_config(plan="plans/p.json", cluster="profiles/c.json", out="runs/r")
ALL_OFF_SWITCHES = RuntimeOptions(lean_p2p=False, overlap_dp=False, hierarchical_dp=False, chunked_loss=False,
                                  compile=False, optimizer="fused")
ALL_OFF = dataclasses.replace(BASE, runtime=ALL_OFF_SWITCHES)


def _worker_words(line: str) -> list[str]:
    """The words after `-m <module>` of one rendered command line (shell-parsed, as the shell would; without the
    `&` that puts an srun line in the background)."""
    words = shlex.split(line.split("#", 1)[0])
    return [word for word in words[words.index("-m") + 2:] if word != "&"]


def test_each_switch_is_saved_in_the_config_and_loaded_back(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    assert BASE.runtime == RuntimeOptions()  # the fast paths unless a switch turns one off
    cases = [{name: False} for name in SWITCHES] + [{"compile": True}, {"compile": False}, {"compile": None},
                                                    {"optimizer": "fused"}, {"optimizer": "foreach"}]
    for switches in cases:
        config = launch_config(plan="p.json", cluster="c.json", out=out, runtime=switches)
        assert config.runtime == RuntimeOptions(**switches)  # type: ignore[arg-type]
        path = save_run_config(config)
        assert path == tmp_path / "run" / "config.json"
        assert json.loads(path.read_text())["runtime"] == dataclasses.asdict(config.runtime)
        assert load_run_config(path) == config


def test_worker_takes_only_the_config_and_the_plan_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_argv("runs/r/config.json", "node0") == ["--config", "runs/r/config.json", "--plan-node", "node0"]
    args = parse_args(worker_argv("runs/r/config.json", "node0"))
    assert (args.config, args.node) == ("runs/r/config.json", "node0")
    assert parse_args(worker_argv("c.json")).node is None
    for old in (["--no-lean-p2p"], ["--plan", "p.json"], ["--lr", "0.1"]):  # settings come from the file only
        with pytest.raises(SystemExit) as exc:
            parse_args([*worker_argv("c.json"), *old])
        assert exc.value.code == 2
    capsys.readouterr()


@pytest.mark.parametrize("template", ["torchrun", "torchrun-elastic", "slurm", "slurm-hetjob"])
def test_rendered_scripts_start_every_worker_with_the_config_only(template: str) -> None:
    settings = RenderSettings(hosts=("10.200.0.1", "10.200.0.2"), template=template,
                              elastic=ElasticRender() if template == "torchrun-elastic" else None)
    for options in (ALL_OFF, BASE):
        if template.startswith("slurm"):
            text = render_slurm(PLAN, CLUSTER, options, settings, SlurmSettings())
            lines = [line for line in text.splitlines() if line.startswith("srun ")]
        else:
            lines = command_lines(render_torchrun(PLAN, CLUSTER, options, settings))
        assert len(lines) == 2  # one per plan node
        for line, node in zip(lines, ("node0", "node1"), strict=True):
            assert _worker_words(line) == ["--config", "runs/r/config.json", "--plan-node", node], line


def test_cli_launch_flags_reach_the_saved_config(tmp_path: Path) -> None:
    from flashflex_cli.cli import main

    script, run = tmp_path / "run.sh", tmp_path / "run"
    code = main(["launch", str(GOLDEN / "plan-4rank.json"), "--cluster", str(GOLDEN / "cluster-2node.json"),
                 "--launcher", "torchrun", "--script", str(script), "--out", str(run), "--no-overlap-dp",
                 "--no-chunked-loss", "--compile", "--optimizer", "foreach"])
    assert code == 0
    for line in command_lines(script.read_text()):
        assert _worker_words(line)[:2] == ["--config", str(run / "config.json")]
    assert load_run_config(run / "config.json").runtime == RuntimeOptions(
        lean_p2p=True, overlap_dp=False, hierarchical_dp=True, compile=True, chunked_loss=False, optimizer="foreach")


def test_cli_launch_takes_the_loss_kernel_cast_once_and_compile_scope(tmp_path: Path) -> None:
    from flashflex_cli.cli import main

    for flags, expected in ((["--loss-kernel", "torch", "--cast-once", "--compile-scope", "stage"],
                             RuntimeOptions(loss_kernel="torch", cast_once=True, compile_scope="stage")),
                            (["--no-cast-once", "--compile-scope", "block"], RuntimeOptions(compile_scope="block")),
                            ([], RuntimeOptions())):
        script, run = tmp_path / f"run{len(flags)}.sh", tmp_path / f"run{len(flags)}"
        code = main(["launch", str(GOLDEN / "plan-4rank.json"), "--cluster", str(GOLDEN / "cluster-2node.json"),
                     "--launcher", "torchrun", "--script", str(script), "--out", str(run), *flags])
        assert code == 0
        assert load_run_config(run / "config.json").runtime == expected


@pytest.mark.parametrize(("flag", "value", "choices"), [("--loss-kernel", "liger", "own, torch"),
                                                        ("--compile-scope", "model", "block, stage, auto")])
def test_cli_refuses_an_unknown_loss_kernel_or_compile_scope_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, choices: str) -> None:
    from flashflex_cli.cli import main

    script, run = tmp_path / "run.sh", tmp_path / "run"
    code = main(["launch", str(GOLDEN / "plan-4rank.json"), "--cluster", str(GOLDEN / "cluster-2node.json"),
                 "--launcher", "torchrun", "--script", str(script), "--out", str(run), flag, value])
    err = capsys.readouterr().err
    assert code == 2 and not script.exists() and not run.exists()
    assert err.strip().splitlines() == [f"error: {flag} must be one of {choices}, got {value!r}"]


def test_cli_refuses_an_unknown_optimizer_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from flashflex_cli.cli import main

    script, run = tmp_path / "run.sh", tmp_path / "run"
    code = main(["launch", str(GOLDEN / "plan-4rank.json"), "--cluster", str(GOLDEN / "cluster-2node.json"),
                 "--launcher", "torchrun", "--script", str(script), "--out", str(run), "--optimizer", "adam"])
    err = capsys.readouterr().err
    assert code == 2 and not script.exists() and not run.exists()
    assert err.strip().splitlines() == ["error: --optimizer must be one of auto, fused, foreach, got 'adam'"]


def test_local_launch_starts_its_workers_with_the_config(tmp_path: Path) -> None:
    """A real supervised one-rank launch of one step: the running worker's own command line (/proc) names only
    RUN/config.json, which holds the switches, and runtime.json records that the worker ran them."""
    options: RunConfig = dataclasses.replace(ALL_OFF, plan=str(GOLDEN / "plan-1rank.json"),
                                             cluster=str(GOLDEN / "cluster-2node.json"), out=str(tmp_path / "run"),
                                             steps=1, timeout_s=60.0)
    seen: list[list[str]] = []
    environments: list[dict[str, str]] = []

    def look(job: LocalJob) -> None:
        for worker in job.running():
            try:
                raw = Path(f"/proc/{worker.proc.pid}/cmdline").read_bytes()
                env = Path(f"/proc/{worker.proc.pid}/environ").read_bytes()
            except OSError:
                continue
            if raw:  # empty once the process exited (a zombie until reaped)
                seen.append(raw.decode().rstrip("\0").split("\0"))
                environments.append(dict(item.split("=", 1) for item in env.decode().split("\0") if "=" in item))

    outcome = run_job(load_plan(options.plan), options, hook=look)
    assert not outcome.failures and not outcome.signals
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    config = str(tmp_path / "run" / "config.json")
    assert seen and all(argv[argv.index("-m") + 2:] == ["--config", config] for argv in seen)
    assert load_run_config(config) == options
    assert environments and all(env.get("PYTORCH_CUDA_ALLOC_CONF") == os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True") for env in environments)
    # the run records which paths ran
    assert json.loads((tmp_path / "run" / "runtime.json").read_text()) == {
        "lean_p2p": False, "overlap_dp": False, "hierarchical_dp": False, "compile": False, "chunked_loss": False,
        "optimizer": "fused", "compute_dtype": "fp32", "loss_kernel": "own", "cast_once": False,
        "compile_scope": "block"}


def test_local_workers_get_expandable_segments_unless_the_user_set_the_allocator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert worker_env(0, 1, 29500, "/tmp/j", 60.0)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert worker_env(0, 1, 29500, "/tmp/j", 60.0)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"


FAKE_TORCHRUN = """#!/bin/sh
printf '%s' "${PYTORCH_CUDA_ALLOC_CONF-unset}" > "$ARGV_DIR/alloc.$$"
"""


@pytest.mark.parametrize("template", ["torchrun", "slurm"])
def test_rendered_lines_give_expandable_segments_unless_the_user_set_the_allocator(template: str,
                                                                                   tmp_path: Path) -> None:
    """Each rendered worker line, run by bash (the line a user runs on a host; for SLURM the srun line's command,
    expanded by the batch script's shell), starts torchrun with expandable segments, or with the user's value
    where PYTORCH_CUDA_ALLOC_CONF is set there."""
    bin_dir, argv_dir = tmp_path / "bin", tmp_path / "argv"
    bin_dir.mkdir()
    argv_dir.mkdir()
    (bin_dir / "torchrun").write_text(FAKE_TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    settings = RenderSettings(hosts=("10.200.0.1", "10.200.0.2"), template=template)
    if template == "slurm":
        text = render_slurm(PLAN, CLUSTER, BASE, settings, SlurmSettings())
        lines = [line.split("--kill-on-bad-exit=1 ", 1)[1].rstrip(" &") for line in text.splitlines()
                 if line.startswith("srun ")]
    else:
        lines = command_lines(render_torchrun(PLAN, CLUSTER, BASE, settings))
    assert len(lines) == 2 and all(line.startswith("env PYTORCH_CUDA_ALLOC_CONF=") for line in lines)
    base_env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    base_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", ARGV_DIR=str(argv_dir))
    for user_value, want in ((None, "expandable_segments:True"), ("max_split_size_mb:64", "max_split_size_mb:64")):
        env = dict(base_env, **({"PYTORCH_CUDA_ALLOC_CONF": user_value} if user_value else {}))
        for line in lines:
            line = line.replace(".venv/bin/torchrun", "torchrun")
            subprocess.run(["bash", "-c", line], env=env, check=True, timeout=60)
        seen = [p.read_text() for p in argv_dir.iterdir()]
        assert seen == [want, want], (user_value, seen)
        for p in argv_dir.iterdir():
            p.unlink()


# ---- benchmarks/bench_runtime_comm.py: its pure helpers (the benchmark itself needs namespaces and minutes) ----
def _bench():  # type: ignore[no-untyped-def]
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_runtime_comm.py"
    spec = importlib.util.spec_from_file_location("bench_runtime_comm", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


@pytest.mark.parametrize("quick", [False, True])
def test_benchmark_plans_are_valid_and_place_what_each_experiment_needs(quick: bool) -> None:
    from flashflex_cli.plan.schema import Plan

    bench = _bench()
    table = bench.experiments(quick)
    assert set(table) == {"a", "b", "c"}
    plans = {key: Plan.model_validate(bench.plan_data(exp, [f"h{i}" for i in range(exp.hosts)], "0" * 64, "x"))
             for key, exp in table.items()}
    # (a) one pipeline: a TP-2 stage on each host, so the boundary crosses hosts
    (pipe,) = plans["a"].pipelines
    assert [[d.split("/")[0] for d in s.devices] for s in pipe.stages] == [["h0", "h0"], ["h1", "h1"]]
    # (b) two pipelines, one per host, each holding every layer: the DP reduction crosses hosts
    assert [[s.devices for s in p.stages] for p in plans["b"].pipelines] == [[["h0/0"]], [["h1/0"]]]
    # (c) every layer held by 6 single-device pipelines, 2 on each of 3 hosts
    hosts = [p.stages[0].devices[0].split("/")[0] for p in plans["c"].pipelines]
    assert sorted(hosts) == ["h0", "h0", "h1", "h1", "h2", "h2"]
    assert all(tuple(p.stages[0].layers) == (0, table["c"].model.num_layers) for p in plans["c"].pipelines)
    assert {key: plan.world_size for key, plan in plans.items()} == {"a": 4, "b": 2, "c": 6}


def test_benchmark_switch_flags_and_figures() -> None:
    bench = _bench()
    table = bench.experiments(True)
    assert bench.switch_flags(table["a"], on=True) == []
    assert bench.switch_flags(table["a"], on=False) == ["--no-lean-p2p"]
    assert bench.switch_flags(table["c"], on=True) == ["--no-overlap-dp"]  # (c) times the whole reduction
    assert bench.switch_flags(table["c"], on=False) == ["--no-overlap-dp", "--no-hierarchical-dp"]
    rows = [{"step_time_s": t, "stages": [{"p2p_s": p, "dp_s": d}, {"p2p_s": 2 * p, "dp_s": 3 * d}]}
            for t, p, d in ((9.0, 9.0, 9.0), (1.0, 0.1, 0.01), (3.0, 0.3, 0.03), (2.0, 0.2, 0.02))]
    fig = bench.figures(rows, warmup=1)  # the first (warm-up) row is left out
    assert (fig.step_s, fig.p2p_s, fig.dp_s) == pytest.approx((2.0, 0.6, 0.06))  # p2p summed, dp the largest
    assert bench.change_pct(2.0, 1.0) == pytest.approx(-50.0)
    assert bench.within(-20.0, -18.0) and not bench.within(-20.0, -10.0) and not bench.within(1.0, 0.0)


def test_benchmark_last_line_has_the_issue_format() -> None:
    import re

    line = _bench().last_line(-45.26, -61.0, -20.04, -22.5, 0.8149)
    assert line == "bench_runtime_comm: p2p -45.3%, exposed dp -61.0%, step -20.0% (predicted -22.5%), hierarchical/flat 0.81"
    assert re.fullmatch(r"bench_runtime_comm: p2p -[\d.]+%, exposed dp -[\d.]+%, step -[\d.]+% "
                        r"\(predicted -[\d.]+%\), hierarchical/flat \d+\.\d\d", line)

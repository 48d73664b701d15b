"""`flashflex plan` and `show` take the runtime switches `launch` takes, so that a plan predicts the launch it
will be run as: the switches a plan was made with are recorded in it (nothing for the defaults), `show` and
`launch` take them from it, and a layer profile is used exactly when its recorded paths are the launch's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.commands.launch import launch_command
from flashflex_cli.commands.planning import plan_command, show_command
from flashflex_cli.layers.schema import LayerProfile, ModelShape, save_layer_profile
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.run_config import load_run_config
from flashflex_cli.semantics.runtime_paths import RuntimeOptions

# a vocabulary of 128k: the whole-vocabulary loss's fp32 logits (1 GiB a micro-batch) outweigh the chunked loss's
PLAN_1B = ["--model", "llama-1b", "--global-batch", "8", "--seq-len", "1024", "--micro-batch", "2", "--no-baseline",
           "--time-budget", "30"]
GPU_PLAN = ["--model", "llama-small", "--global-batch", "8", "--seq-len", "128", "--dtype", "bf16", "--no-baseline",
            "--micro-batch", "1", "--time-budget", "30"]


def _json_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _memory(plan: dict) -> list[float]:
    return [stage["memory_bytes"] for stage in plan["predicted"]["stages"]]


@pytest.fixture
def gpu(tmp_path: Path) -> dict[str, Path]:
    cluster = tmp_path / "a100.json"
    assert main(["profile", "--synthetic", "1x2xA100-80G-SXM", "--out", str(cluster)]) == 0
    plan = tmp_path / "plan.json"
    assert main(["plan", str(cluster), *PLAN_1B, "--out", str(plan)]) == 0
    return {"cluster": cluster, "plan": plan, "dir": tmp_path}


def test_plan_show_and_launch_declare_the_same_switches() -> None:
    """One declaration: the same option objects, with the same flags, in all three commands."""
    import inspect

    def switch_options(command) -> dict[str, object]:  # noqa: ANN001 - a typer command function
        names = ("lean_p2p", "overlap_dp", "hierarchical_dp", "compile_", "chunked_loss", "optimizer")
        return {name: inspect.signature(command).parameters[name].default for name in names}

    plan, show, launch = (switch_options(c) for c in (plan_command, show_command, launch_command))
    assert plan == show == launch
    assert all(option is show[name] for name, option in plan.items())


def test_show_without_the_chunked_loss_predicts_more_memory(gpu: dict[str, Path],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    default = _json_of(["show", str(gpu["plan"]), "--cluster", str(gpu["cluster"]), "--json"], capsys)
    # no --cluster: a switch predicts afresh on the cluster file the plan records
    whole = _json_of(["show", str(gpu["plan"]), "--no-chunked-loss", "--json"], capsys)
    assert whole["inputs"]["runtime"]["chunked_loss"] is False and "runtime" not in default["inputs"]
    # the last stage holds the head: its [tokens, vocab] fp32 logits at once, not a chunk of them
    assert _memory(whole)[-1] > _memory(default)[-1]
    assert max(_memory(whole)) > max(_memory(default))
    assert main(["show", str(gpu["plan"]), "--no-chunked-loss"]) == 0
    assert "predicted for a launch with --no-chunked-loss" in capsys.readouterr().out


def test_plan_with_a_switch_predicts_what_show_with_it_predicts(gpu: dict[str, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    switched = gpu["dir"] / "whole-loss.json"
    planned = _json_of(["plan", str(gpu["cluster"]), *PLAN_1B, "--no-chunked-loss", "--optimizer", "fused",
                        "--out", str(switched), "--json"], capsys)
    assert planned["inputs"]["runtime"] == {"lean_p2p": True, "overlap_dp": True, "hierarchical_dp": True,
                                            "chunked_loss": False, "optimizer": "fused"}
    assert "runtime" not in json.loads(gpu["plan"].read_text())["inputs"]  # the defaults: nothing recorded
    shown = _json_of(["show", str(switched), "--cluster", str(gpu["cluster"]), "--no-chunked-loss", "--optimizer",
                      "fused", "--json"], capsys)
    assert shown["predicted"] == planned["predicted"]
    # without the switches, show takes the ones the plan records: the same prediction again
    assert _json_of(["show", str(switched), "--cluster", str(gpu["cluster"]), "--json"], capsys) == planned
    # a switch given to show overrides the plan's: the chunked loss holds less
    chunked = _json_of(["show", str(switched), "--cluster", str(gpu["cluster"]), "--chunked-loss", "--json"], capsys)
    assert _memory(chunked)[-1] < _memory(planned)[-1]
    assert load_plan(switched).inputs.runtime_options() == RuntimeOptions(chunked_loss=False, optimizer="fused")
    report = _json_of(["diff", str(gpu["plan"]), str(switched), "--json"], capsys)
    assert "runtime switches: launch defaults -> --no-chunked-loss --optimizer fused" in report["changes"]


def test_launch_takes_the_switches_the_plan_was_predicted_for(gpu: dict[str, Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    switched = gpu["dir"] / "eager.json"
    assert main(["plan", str(gpu["cluster"]), *PLAN_1B, "--no-chunked-loss", "--out", str(switched)]) == 0
    run, script = gpu["dir"] / "run", gpu["dir"] / "run.sh"
    capsys.readouterr()
    assert main(["launch", str(switched), "--launcher", "torchrun", "--out", str(run), "--script", str(script),
                 "--optimizer", "foreach"]) == 0
    assert "runtime switches the plan was predicted for: --no-chunked-loss" in capsys.readouterr().err
    assert load_run_config(run / "config.json").runtime == RuntimeOptions(chunked_loss=False, optimizer="foreach")


def test_show_refuses_switches_with_a_run_folder(gpu: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["show", str(gpu["plan"]), "--run", str(gpu["dir"]), "--compile"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--compile and --run contradict each other" in err
    assert main(["show", str(gpu["plan"]), "--optimizer", "adam"]) == 2
    assert capsys.readouterr().err == "error: --optimizer must be one of auto, fused, foreach, got 'adam'\n"


def _eager_a100_profile(path: Path) -> Path:
    """A layer profile of an A100 measured eager (not compiled) with the chunked loss."""
    part = {"fwd_s": 1e-3, "bwd_s": 2e-3, "activation_bytes": 1e6}
    profile = LayerProfile.model_validate({
        "schema": "flashflex.layers/1", "device_type": "A100-80G-SXM",
        "model": ModelShape.of(PRESETS["llama-small"]).model_dump(), "seq_len": 128, "dtype": "bf16",
        "attention": "sdpa", "runtime": {"compile": False, "chunked_loss": True},
        "entries": [{"micro_batch_size": 1, "tp": 1, "layer": part, "embedding": part, "head": part}]})
    save_layer_profile(path, profile)
    return path


def test_an_eager_layer_profile_is_used_for_an_eager_launch_only(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    cluster, plan = tmp_path / "a100.json", tmp_path / "plan.json"
    assert main(["profile", "--synthetic", "1x2xA100-80G-SXM", "--out", str(cluster)]) == 0
    layers = _eager_a100_profile(tmp_path / "a100-eager.layers.json")
    capsys.readouterr()
    # planned for an eager launch: the profile costs every stage
    eager = _json_of(["plan", str(cluster), *GPU_PLAN, "--layers", str(layers), "--no-compile", "--out", str(plan),
                      "--json"], capsys)
    assert eager["inputs"]["layer_profiles"] and eager["inputs"]["runtime"]["compile"] is False
    assert all(stage["source"].startswith("measured") for stage in eager["predicted"]["stages"])
    shown = _json_of(["show", str(plan), "--cluster", str(cluster), "--layers", str(layers), "--json"], capsys)
    assert shown["predicted"] == eager["predicted"]  # the plan's recorded --no-compile: the profile again
    # shown for a compiled launch (a GPU's default): the profile is left out, and one line says which path differs
    assert main(["show", str(plan), "--cluster", str(cluster), "--layers", str(layers), "--compile", "--json"]) == 0
    captured = capsys.readouterr()
    compiled = json.loads(captured.out)
    assert "layer_profiles" not in compiled["inputs"]
    assert all(stage["source"] == "modelled" for stage in compiled["predicted"]["stages"])
    notes = [line for line in captured.err.splitlines() if "matched no stage" in line]
    assert len(notes) == 1, captured.err
    assert ("layer profile of A100-80G-SXM (eager, chunked loss) matched no stage: it was measured with --no-compile, "
            "the launch predicted takes --compile") in notes[0]


def test_cast_once_is_declared_once_and_launch_alone_takes_the_loss_kernel_and_compile_scope() -> None:
    import inspect

    from flashflex_cli.commands import runtime_switches as switches

    def parameters(command) -> dict[str, object]:  # noqa: ANN001 - a typer command function
        return {name: p.default for name, p in inspect.signature(command).parameters.items()}

    plan, show, launch = (parameters(c) for c in (plan_command, show_command, launch_command))
    assert plan["cast_once"] is show["cast_once"] is launch["cast_once"] is switches.CAST_ONCE
    assert launch["loss_kernel"] is switches.LOSS_KERNEL and launch["compile_scope"] is switches.COMPILE_SCOPE
    # the cost model charges both loss kernels and both compile scopes alike: a plan does not record them
    assert "loss_kernel" not in plan and "compile_scope" not in show


def test_a_plan_predicted_cast_once_records_it_and_show_and_launch_take_it(gpu: dict[str, Path],
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    once, again = gpu["dir"] / "cast-once.json", gpu["dir"] / "cast-once-again.json"
    capsys.readouterr()
    default = _json_of(["show", str(gpu["plan"]), "--cluster", str(gpu["cluster"]), "--json"], capsys)
    planned = _json_of(["plan", str(gpu["cluster"]), *PLAN_1B, "--cast-once", "--out", str(once), "--json"], capsys)
    assert main(["plan", str(gpu["cluster"]), *PLAN_1B, "--cast-once", "--out", str(again)]) == 0
    assert once.read_bytes() == again.read_bytes()  # deterministic
    capsys.readouterr()
    assert planned["inputs"]["runtime"] == {"lean_p2p": True, "overlap_dp": True, "hierarchical_dp": True,
                                            "chunked_loss": True, "optimizer": "auto", "cast_once": True}
    assert load_plan(once).inputs.runtime_options() == RuntimeOptions(cast_once=True)
    # the plan made without it records nothing and loads with it off
    assert "runtime" not in json.loads(gpu["plan"].read_text())["inputs"]
    assert load_plan(gpu["plan"]).inputs.runtime_options().cast_once is False
    # one cast per step instead of one per micro-batch, and no copy per micro-batch in flight
    shown = _json_of(["show", str(gpu["plan"]), "--cast-once", "--json"], capsys)
    assert shown["inputs"]["runtime"]["cast_once"] is True
    assert shown["predicted"]["iteration_time_s"] < default["predicted"]["iteration_time_s"]
    assert all(a <= b for a, b in zip(_memory(shown), _memory(default), strict=True))
    # show takes the plan's switch, and --no-cast-once gives the default prediction back
    assert _json_of(["show", str(once), "--cluster", str(gpu["cluster"]), "--json"], capsys) == planned
    off = _json_of(["show", str(once), "--cluster", str(gpu["cluster"]), "--no-cast-once", "--json"], capsys)
    assert "runtime" not in off["inputs"] and off["predicted"] == default["predicted"]
    assert main(["show", str(once)]) == 0
    assert "predicted for a launch with --cast-once" in capsys.readouterr().out
    run, script = gpu["dir"] / "run", gpu["dir"] / "run.sh"
    assert main(["launch", str(once), "--launcher", "torchrun", "--out", str(run), "--script", str(script)]) == 0
    assert "runtime switches the plan was predicted for: --cast-once" in capsys.readouterr().err
    assert load_run_config(run / "config.json").runtime == RuntimeOptions(cast_once=True)


def test_cast_once_charges_one_weight_cast_a_step_instead_of_one_a_micro_batch(tmp_path: Path) -> None:
    """On one stage the schedule is the micro-batches one after the other: cast once, a step of m micro-batches
    takes m - 1 casts of the stage's weights less (none less with one micro-batch)."""
    import dataclasses

    from flashflex_cli.cost.compute import weight_cast_s
    from flashflex_cli.cost.estimate import estimate
    from flashflex_cli.cost.params import CostParams
    from flashflex_cli.hardware.cluster import load_cluster
    from flashflex_cli.plan.schema import Plan

    cluster_file = tmp_path / "a100.json"
    assert main(["profile", "--synthetic", "1x1xA100-80G-SXM", "--out", str(cluster_file)]) == 0
    cluster, spec = load_cluster(cluster_file), PRESETS["llama-1b"]

    def plan(m: int) -> Plan:
        return Plan.model_validate({
            "schema": "flashflex.plan/1",
            "inputs": {"cluster_sha256": "test", "model": spec.model_dump(),
                       "train": {"global_batch": 2 * m, "seq_len": 1024, "dtype": "bf16"}},
            "pipelines": [{"micro_batch_size": 2, "num_micro_batches": m, "stages": [
                {"devices": cluster.device_ids, "tp": 1, "layers": [0, spec.num_layers]}]}]})

    eager = CostParams().for_launch(RuntimeOptions(compile=False))
    once = dataclasses.replace(eager, runtime=RuntimeOptions(compile=False, cast_once=True))
    train = plan(1).inputs.train
    cast = weight_cast_s(cluster, cluster.device_ids, spec, train, once, spec.num_layers)
    assert cast > 0 and weight_cast_s(cluster, cluster.device_ids, spec, train, eager, spec.num_layers) == 0
    for m in (1, 4):
        each, shared = estimate(plan(m), cluster, eager), estimate(plan(m), cluster, once)
        assert shared.stages[0].weight_cast_s == cast
        saved = each.iteration_time_s - shared.iteration_time_s
        assert saved == pytest.approx((m - 1) * cast, rel=1e-9, abs=1e-12)
        assert saved > 0 if m > 1 else True
    # in fp32 nothing is cast: the same prediction either way
    fp32 = plan(4).model_copy(update={"inputs": plan(4).inputs.model_copy(update={
        "train": train.model_copy(update={"dtype": "fp32"})})})
    assert estimate(fp32, cluster, once).iteration_time_s == estimate(fp32, cluster, eager).iteration_time_s

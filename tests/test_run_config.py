"""The run configuration (run_config.py, RUN/config.json): saved and loaded unchanged, every impossible value and
every unknown, missing or mistyped key refused in one line naming the field, the launch's learning-rate policy in
one place, and a real multi-process run trains with exactly what the launcher saved."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flashflex_cli.cli import main
from flashflex_cli.errors import InputError
from flashflex_cli.launch.options import launch_config
from flashflex_cli.run_config import (
    ADDED_LATER,
    SCHEMA,
    LossScaling,
    OptimConfig,
    RunConfig,
    build_checked,
    default_optimizer,
    from_dict,
    load_run_config,
    save_run_config,
)
from flashflex_cli.semantics.runtime_paths import RuntimeOptions

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = str(GOLDEN / "cluster-2node.json")

CUSTOM = RunConfig(plan="plans/p.json", cluster="profiles/c.json", out="runs/r", data="runs/tokens.bin", steps=7,
                   seed=11, timeout_s=12.5, checkpoint_dir="runs/ck", checkpoint_every=3, resume=True,
                   init_from="hf/llama", runtime=RuntimeOptions(lean_p2p=False, compile=True, optimizer="fused"),
                   optimizer=OptimConfig(lr=2e-3, min_lr=0.0, warmup_steps=0, total_steps=9, weight_decay=0.0,
                                         betas=(0.0, 0.5), eps=1e-6, grad_clip=0.0),
                   loss_scaling=LossScaling(init_scale=1.0, growth_factor=4.0, backoff_factor=0.25,
                                            growth_interval=1))


def _data(config: RunConfig = CUSTOM) -> dict[str, Any]:
    return json.loads(config.to_json())


def _set(data: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """A copy of `data` with `field` ("optimizer.lr") set to `value` (a _DROP value removes it)."""
    out = copy.deepcopy(data)
    *sections, name = field.split(".")
    target = out
    for section in sections:
        target = target[section]
    if value is _DROP:
        del target[name]
    else:
        target[name] = value
    return out


_DROP = object()


def test_save_and_load_give_the_same_config(tmp_path: Path) -> None:
    for config in (CUSTOM, launch_config(plan="p.json", cluster="c.json", out="o")):
        config = dataclasses.replace(config, out=str(tmp_path / "run"))
        path = save_run_config(config)
        assert path == tmp_path / "run" / "config.json" == config.path
        assert load_run_config(path) == config
        text = path.read_text()
        assert text == config.to_json() and text.endswith("}\n")
        data = json.loads(text)
        assert data["schema"] == SCHEMA and list(data) == sorted(data)
        assert list(data["optimizer"]) == sorted(data["optimizer"])
        save_run_config(config)
        assert path.read_text() == text  # deterministic
        assert [p.name for p in path.parent.iterdir()] == ["config.json"]  # atomic: no temporary left


def test_the_saved_file_holds_every_setting_by_its_name() -> None:
    data = _data()
    assert set(data) == {"schema", "plan", "cluster", "out", "data", "steps", "seed", "timeout_s", "setup_timeout_s",
                         "checkpoint_dir", "checkpoint_every", "resume", "init_from", "share_gpu", "gpus", "runtime",
                         "optimizer", "loss_scaling", "metrics"}
    assert data["metrics"] == ["jsonl", "console"]
    assert data["runtime"] == {"lean_p2p": False, "overlap_dp": True, "hierarchical_dp": True, "compile": True,
                               "chunked_loss": True, "optimizer": "fused", "loss_kernel": "own", "cast_once": False,
                               "compile_scope": "auto"}
    assert data["optimizer"] == {"lr": 2e-3, "min_lr": 0.0, "warmup_steps": 0, "total_steps": 9,
                                 "weight_decay": 0.0, "betas": [0.0, 0.5], "eps": 1e-6, "grad_clip": 0.0}
    assert data["loss_scaling"] == {"init_scale": 1.0, "growth_factor": 4.0, "backoff_factor": 0.25,
                                    "growth_interval": 1}


def test_the_learning_rate_policy_of_a_launch() -> None:
    assert default_optimizer(1e-3, 30) == OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=3, total_steps=30)
    assert default_optimizer(1e-3, 1).warmup_steps == 1  # at least one warm-up step ...
    assert default_optimizer(1e-3, 1000).warmup_steps == 10  # ... at most ten
    config = launch_config(plan="p", cluster="c", out="o", steps=30, lr=2e-3)
    assert config.optimizer == default_optimizer(2e-3, 30)  # the schedule spans --steps ...
    config = launch_config(plan="p", cluster="c", out="o", steps=30, schedule_steps=100)
    assert config.optimizer == default_optimizer(1e-3, 100)  # ... or --schedule-steps
    assert config.runtime == RuntimeOptions() and config.loss_scaling == LossScaling()


# (field, value, what the one-line error says after the field's name)
IMPOSSIBLE = [
    ("optimizer.lr", -1e-3, "must be positive"),
    ("optimizer.lr", 0, "must be positive"),
    ("optimizer.lr", math.nan, "must be a finite number"),
    ("optimizer.lr", 10**400, "must be a finite number"),
    ("optimizer.min_lr", 3e-3, "must be at most lr (0.002)"),
    ("optimizer.min_lr", -1e-5, "must be 0 or more"),
    ("optimizer.betas", [1.0, 0.9], "must be two numbers in [0, 1)"),
    ("optimizer.betas", [0.9, -0.1], "must be two numbers in [0, 1)"),
    ("optimizer.betas", [0.9], "must be a list of 2 numbers"),
    ("optimizer.warmup_steps", 10, "must be at most total_steps (9)"),
    ("optimizer.warmup_steps", -1, "must be an integer in [0, "),
    ("optimizer.total_steps", 0, "must be an integer in [1, "),
    ("optimizer.weight_decay", -0.1, "must be 0 or more"),
    ("optimizer.eps", 0.0, "must be positive"),
    ("optimizer.grad_clip", -1.0, "must be 0 or more"),
    ("optimizer.grad_clip", math.inf, "must be a finite number"),
    ("loss_scaling.growth_factor", 1.0, "must be more than 1"),
    ("loss_scaling.growth_factor", 0.5, "must be more than 1"),
    ("loss_scaling.backoff_factor", 1.0, "must be in (0, 1)"),
    ("loss_scaling.backoff_factor", 0, "must be in (0, 1)"),
    ("loss_scaling.init_scale", 0.0, "must be positive"),
    ("loss_scaling.init_scale", 1e39, "must be at most 3.40282e+38"),
    ("loss_scaling.growth_interval", 0, "must be an integer in [1, 2147483647]"),
    ("loss_scaling.growth_interval", 2**31, "must be an integer in [1, 2147483647]"),
    ("runtime.optimizer", "adam", "must be one of auto, fused, foreach"),
    ("steps", 0, "must be an integer in [1, "),
    ("steps", 10**400, "must be an integer in [1, "),
    ("seed", -1, "must be an integer in [0, 4294967295]"),
    ("timeout_s", 0, "must be positive"),
    ("timeout_s", 1e7, "must be at most"),
    ("setup_timeout_s", 0, "must be positive"),
    ("setup_timeout_s", 1e7, "must be at most"),
    ("setup_timeout_s", 12.0, "must be at least timeout_s (--timeout: 12.5), got 12"),
    ("setup_timeout_s", "600", "must be a number or null, got '600'"),
    ("checkpoint_every", -1, "must be an integer in [0, "),
    ("plan", "", "must be a path"),
    ("out", "", "must be a path"),
    # wrong JSON types: no conversion, whatever Python would accept
    ("steps", 1.5, "must be a whole number, got 1.5"),
    ("steps", True, "must be a whole number, got True"),
    ("optimizer.lr", "0.001", "must be a number, got '0.001'"),
    ("optimizer.lr", False, "must be a number"),
    ("resume", "false", "must be true or false"),
    ("runtime.lean_p2p", 1, "must be true or false"),
    ("runtime.compile", "auto", "must be true or false or null"),
    ("plan", 3, "must be a string"),
    ("checkpoint_dir", ["a"], "must be a string or null"),
    ("metrics", "jsonl", "must be a list, each one of jsonl, console, tensorboard, wandb, got 'jsonl'"),
    ("metrics", ["console", "console"], "names console twice"),
    ("optimizer.betas", [0.9, "0.95"], "must be a list of 2 numbers, got [0.9, '0.95']"),
    # unknown and missing keys
    ("lrate", 0.1, "is no setting"),
    ("optimizer.momentum", 0.9, "is no setting"),
    ("runtime.fast", True, "is no setting"),
    ("optimizer.eps", _DROP, "is missing"),
    ("loss_scaling", _DROP, "is missing"),
    ("runtime", [], "must be an object"),
]


@pytest.mark.parametrize(("field", "value", "problem"), IMPOSSIBLE,
                         ids=[f"{f}={v if v is not _DROP else 'absent'}"[:40] for f, v, _ in IMPOSSIBLE])
def test_an_impossible_or_unknown_setting_is_refused_by_name(tmp_path: Path, field: str, value: Any,
                                                             problem: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_set(_data(), field, value)))
    with pytest.raises(InputError) as exc:
        load_run_config(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: {field} {problem}"), message
    assert "\n" not in message


def test_a_file_of_another_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    for text, problem in ((json.dumps(_set(_data(), "schema", "flashflex.run/2")), "unknown schema 'flashflex.run/2'"),
                          (json.dumps(_set(_data(), "schema", _DROP)), "unknown schema None"),
                          ("[]", "expected a JSON object"), ("{", "malformed JSON")):
        path.write_text(text)
        with pytest.raises(InputError, match=f"^{path}: .*{problem}"):
            load_run_config(path)
    with pytest.raises(InputError, match="no such file"):
        load_run_config(tmp_path / "none.json")


def test_settings_built_in_code_are_checked_too() -> None:
    with pytest.raises(InputError, match="^min_lr must be at most lr"):
        OptimConfig(lr=1e-4, min_lr=1e-3)
    with pytest.raises(InputError, match="^warmup_steps must be at most total_steps"):
        OptimConfig(warmup_steps=20, total_steps=10)
    with pytest.raises(InputError, match="^growth_factor must be more than 1"):
        LossScaling(growth_factor=1.0)
    with pytest.raises(InputError, match="^steps must be an integer"):
        dataclasses.replace(CUSTOM, steps=0)
    assert from_dict(_data()) == CUSTOM


def test_settings_are_frozen_and_refused_in_one_line_however_they_are_built() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CUSTOM.steps = 3  # type: ignore[misc]
    with pytest.raises(InputError, match=r"^optimizer\.min_lr must be at most lr \(0\.0001\), got 0\.001$"):
        build_checked(OptimConfig, {"lr": 1e-4, "min_lr": 1e-3}, "optimizer")
    with pytest.raises(InputError, match=r"^min_lr must be at most lr \(0\.0001\), got 0\.001$"):
        OptimConfig(lr=1e-4, min_lr=1e-3)
    with pytest.raises(InputError, match=r"^steps must be a whole number, got 1\.5$"):
        dataclasses.replace(CUSTOM, steps=1.5)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^lr must be a finite number, got inf$"):
        OptimConfig(lr=10**400)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^betas must be two numbers in \[0, 1\), got \(0\.9, 1\.0\)$"):
        OptimConfig(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"^optimizer must be one of auto, fused, foreach, got 'adam'$"):
        RuntimeOptions(optimizer="adam")  # type: ignore[arg-type]
    assert OptimConfig(lr=1).lr == 1.0 and isinstance(OptimConfig(lr=1).lr, float)  # an integer for a number


def test_a_file_written_before_a_setting_existed_loads_with_its_default(tmp_path: Path) -> None:
    """Keys added to flashflex.run/1 after its first version (ADDED_LATER) may be absent; any other may not."""
    data = _data()
    for key in ADDED_LATER:
        data.pop(key)
    assert set(ADDED_LATER) == {"setup_timeout_s", "share_gpu", "gpus", "metrics"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    config = load_run_config(path)
    assert config == dataclasses.replace(CUSTOM, setup_timeout_s=None, share_gpu=False, gpus=None,
                                         metrics=("jsonl", "console"))
    path.write_text(json.dumps(_set(data, "seed", _DROP)))
    with pytest.raises(InputError, match=f"^{path}: seed is missing$"):
        load_run_config(path)


def test_the_metrics_sinks_are_recorded_with_jsonl_always_first(tmp_path: Path) -> None:
    config = launch_config(plan="p.json", cluster="c.json", out="o", metrics=("tensorboard", "console"))
    assert config.metrics == ("jsonl", "console", "tensorboard")  # canonical order, jsonl always on
    assert json.loads(config.to_json())["metrics"] == ["jsonl", "console", "tensorboard"]
    assert launch_config(plan="p.json", cluster="c.json", out="o").metrics == ("jsonl", "console")
    with pytest.raises(InputError, match="^--metrics names wandb twice$"):
        launch_config(plan="p.json", cluster="c.json", out="o", metrics=("wandb", "wandb"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_set(_data(), "metrics", ["jsonl", "csv"])))
    with pytest.raises(InputError, match=f"^{path}: metrics.1 must be one of jsonl, console, tensorboard, wandb, "
                                         "got 'csv'$"):
        load_run_config(path)


@pytest.mark.parametrize(("options", "message"), [
    ({"lr": 0.0}, "--lr must be positive, got 0.0"),
    ({"steps": 0}, "--steps must be an integer in [1, 1000000000], got 0"),
    ({"schedule_steps": 0}, "--schedule-steps must be an integer in [1, 1000000000], got 0"),
    ({"timeout_s": math.inf}, "--timeout must be a finite number, got inf"),
    ({"setup_timeout_s": 30.0}, "--setup-timeout must be at least timeout_s (--timeout: 60), got 30"),
    ({"checkpoint_every": -1}, "--checkpoint-every must be an integer in [0, 1000000000], got -1"),
    ({"seed": 2**32}, "--seed must be an integer in [0, 4294967295], got 4294967296"),
    ({"runtime": {"optimizer": "adam"}}, "--optimizer must be one of auto, fused, foreach, got 'adam'"),
])
def test_a_launch_names_the_option_of_a_bad_value(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as exc:
        launch_config(plan="p.json", cluster="c.json", out="o", **options)
    assert str(exc.value) == message


def test_a_worker_given_a_bad_config_exits_2_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_set(_data(), "optimizer.lr", -1.0)))
    result = subprocess.run([sys.executable, "-m", "flashflex_cli.runtime.training.worker", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"flashflex worker local rank ? failed: InputError: {path}: optimizer.lr must be positive, got -1.0"]


@pytest.mark.parametrize("argv", [
    ["--lr", "0"],  # an impossible number
    ["--steps", "3", "--optimizer", "adam"],  # an unknown switch value
    ["--data", "{d}/none.bin"],  # missing data
    ["--checkpoint-every", "2", "--no-checkpoint"],  # options that contradict each other
])
def test_a_launch_given_bad_input_writes_no_config(tmp_path: Path, argv: list[str]) -> None:
    for launcher in ("local", "torchrun"):
        run = tmp_path / launcher
        code = main(["launch", str(GOLDEN / "plan-1rank.json"), "--cluster", CLUSTER, "--out", str(run),
                     "--launcher", launcher, *[a.replace("{d}", str(tmp_path)) for a in argv]])
        assert code == 2 and not run.exists(), launcher


def test_the_config_may_not_overwrite_an_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    plan = run / "config.json"  # a plan file saved under the run configuration's name
    plan.write_bytes((GOLDEN / "plan-1rank.json").read_bytes())
    for launcher in ("local", "torchrun"):
        code = main(["launch", str(plan), "--cluster", CLUSTER, "--out", str(run), "--launcher", launcher])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "the run configuration" in err[0] and "is also an input" in err[0]
        assert plan.read_bytes() == (GOLDEN / "plan-1rank.json").read_bytes()


def test_a_launch_into_a_folder_a_running_launch_holds_leaves_its_config(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from flashflex_cli.launch.lock import run_lock

    run = tmp_path / "run"
    running = save_run_config(launch_config(plan="p.json", cluster="c.json", out=str(run)))
    before = running.read_bytes()
    with run_lock(run, None):  # a running local launch holds the run folder
        for launcher in ("local", "torchrun", "slurm"):
            code = main(["launch", str(GOLDEN / "plan-1rank.json"), "--cluster", CLUSTER, "--out", str(run),
                         "--launcher", launcher, "--steps", "3"])
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 1 and "is in use by a running launch" in err[0], (launcher, err)
    assert running.read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json"]


# ---- a real run trains with what the launcher saved --------------------------------------------------------------

# Loss tolerance, as in tests/test_launch.py: each loss is an fp32 mean over the 256 tokens of a global batch; the
# plan changes only the summation order (fp32 rounding ~6e-8 per add, ~1e-6 over the batch, carried through 4
# AdamW steps), and metrics.jsonl rounds losses (~5.5) to 6 decimals. 1e-5 relative leaves a margin of 5.
REL = 1e-5
STEPS = 4
# Every setting off its default: another peak and final learning rate and warm-up, strong weight decay, other
# betas, eps and clipping; the fused AdamW kernels and the unchunked loss.
OPTIM = OptimConfig(lr=4e-3, min_lr=1e-3, warmup_steps=2, total_steps=6, weight_decay=0.5, betas=(0.8, 0.9),
                    eps=1e-6, grad_clip=0.5)


@pytest.mark.slow
def test_a_launched_run_trains_with_the_saved_config(tmp_path: Path) -> None:
    """Three gloo ranks (a two-stage pipeline and a one-stage pipeline) launched by the supervised local launcher
    with a config whose every optimizer setting is off the launch's policy: the lr column follows the config's
    schedule, runtime.json records its switches, and the losses match the one-process reference trained with the
    same OptimConfig, and not the reference trained with the policy's (so every setting took effect)."""
    from flashflex_cli.launch.local import launch_local
    from flashflex_cli.plan.schema import load_plan
    from flashflex_cli.runtime.training.data import open_source
    from flashflex_cli.runtime.training.optimizer import lr_at
    from flashflex_cli.runtime.training.reference import reference_train

    plan_path = GOLDEN / "plan-3rank.json"
    base = launch_config(plan=str(plan_path), cluster=CLUSTER, out=str(tmp_path / "run"), steps=STEPS,
                         timeout_s=60.0, runtime={"optimizer": "fused", "chunked_loss": False})
    config = dataclasses.replace(base, optimizer=OPTIM)
    plan = load_plan(plan_path)
    launch_local(plan, config)

    run = tmp_path / "run"
    assert load_run_config(run / "config.json") == config  # the launcher saved it before the workers started
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["lr"] for row in rows] == pytest.approx([lr_at(step, OPTIM) for step in range(STEPS)], rel=1e-6)
    assert [row["lr"] for row in rows] != pytest.approx([lr_at(s, base.optimizer) for s in range(STEPS)], rel=1e-3)
    runtime = json.loads((run / "runtime.json").read_text())
    assert (runtime["optimizer"], runtime["chunked_loss"], runtime["lean_p2p"]) == ("fused", False, True)

    train, model = plan.inputs.train, plan.inputs.model
    source = open_source("synthetic", model.vocab_size, train.global_batch, train.seq_len, seed=config.seed)
    batches = [source.global_batch(step) for step in range(STEPS)]
    want = reference_train(model, batches, OPTIM, seed=config.seed).losses
    other = reference_train(model, batches, base.optimizer, seed=config.seed).losses
    got = [row["loss"] for row in rows]
    assert got == pytest.approx(want, rel=REL)
    assert got[1:] != pytest.approx(other[1:], rel=100 * REL)  # the settings change the trajectory measurably
    assert os.path.exists(run / "plan.json") and os.path.exists(run / "cluster.json")


def test_the_long_timeout_defaults_to_at_least_ten_minutes_and_never_below_the_run_timeout() -> None:
    config = launch_config(plan="p.json", cluster="c.json", out="o")
    assert config.setup_timeout_s is None and config.setup_seconds == 600.0
    assert launch_config(plan="p.json", cluster="c.json", out="o", timeout_s=900.0).setup_seconds == 900.0
    assert launch_config(plan="p.json", cluster="c.json", out="o", setup_timeout_s=75.0).setup_seconds == 75.0
    assert from_dict(json.loads(config.to_json())).setup_seconds == 600.0  # null in the file

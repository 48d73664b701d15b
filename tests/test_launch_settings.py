"""Every setting of the run configuration (run_config.RunConfig and its parts) is set by a `flashflex launch` option
or is listed here with what sets it instead, and each option's default is the setting a launch without it records:
a setting added to RunConfig without its option, or an option whose default drifts from the setting's, fails here."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperArgument

from flashflex_cli.cli import app
from flashflex_cli.launch.options import LAUNCH_OPTIONS, launch_config
from flashflex_cli.run_config import RunConfig
from flashflex_cli.semantics.metrics_sinks import parse_sinks

# Settings no launch option sets, and what sets them.
SET_OTHERWISE: dict[str, str] = {
    "optimizer.min_lr": "the launch's learning-rate policy (run_config.default_optimizer): --lr / 10",
    "optimizer.warmup_steps": "the launch's learning-rate policy: a tenth of --schedule-steps, 1 to 10",
    "optimizer.weight_decay": "AdamW's setting in OptimConfig",
    "optimizer.betas": "AdamW's setting in OptimConfig",
    "optimizer.eps": "AdamW's setting in OptimConfig",
    "optimizer.grad_clip": "AdamW's setting in OptimConfig",
    "loss_scaling.init_scale": "torch.amp.GradScaler's default in LossScaling",
    "loss_scaling.growth_factor": "torch.amp.GradScaler's default in LossScaling",
    "loss_scaling.backoff_factor": "torch.amp.GradScaler's default in LossScaling",
    "loss_scaling.growth_interval": "torch.amp.GradScaler's default in LossScaling",
}
# Options whose default is no value but a rule the launch applies, and the rule.
DEFAULT_BY_RULE: dict[str, str] = {
    "plan": "the PLAN argument, always given",
    "cluster": "None: the cluster file the plan records (launch/recorded_cluster.py)",
    "out": "a path the launch always passes (runs/run by default)",
    "checkpoint_dir": "None: RUN/checkpoints, or the folder the run's config.json names (launch/options.py)",
    "checkpoint_every": "None: 500 with a checkpoint folder, 0 with --no-checkpoint (commands/launch.py)",
    "optimizer.total_steps": "None: --steps",
    **{f"runtime.{name}": "None: the switch the plan was predicted for (its inputs.runtime), else the runtime's "
       "default (commands/runtime_switches.py)"
       for name in ("lean_p2p", "overlap_dp", "hierarchical_dp", "compile", "chunked_loss", "optimizer",
                    "loss_kernel", "cast_once", "compile_scope")},
}


def _setting_paths(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every setting of `cls`, a part's as "part.name"."""
    paths = []
    for field in fields(cls):
        default = getattr(launch_config(plan="p", cluster="c", out="o"), field.name) if cls is RunConfig else None
        if is_dataclass(default):
            paths += _setting_paths(type(default), f"{field.name}.")
        else:
            paths.append(prefix + field.name)
    return paths


def _launch_parameters() -> dict[str, Any]:
    """The launch command's parameters by every name it is given on the command line ("PLAN" for the argument)."""
    command = typer.main.get_command(app).commands["launch"]  # type: ignore[attr-defined]
    named: dict[str, Any] = {}
    for parameter in command.params:
        if isinstance(parameter, TyperArgument):
            named["PLAN"] = parameter
        for name in (*parameter.opts, *parameter.secondary_opts):
            named[name] = parameter
    return named


def _option_of(path: str, named: dict[str, Any]) -> str | None:
    """The option that sets setting `path`: LAUNCH_OPTIONS' name, else --NAME, else --no-NAME for a switch that
    is on by default."""
    leaf = path.rpartition(".")[2].replace("_", "-")
    for option in (LAUNCH_OPTIONS.get(path), f"--{leaf}", f"--no-{leaf}"):
        if option is not None and option in named:
            return option
    return None


def _value(path: str, config: RunConfig) -> Any:
    value: Any = config
    for name in path.split("."):
        value = getattr(value, name)
    return value


def test_every_setting_has_a_launch_option_or_is_set_otherwise() -> None:
    named = _launch_parameters()
    paths = _setting_paths()
    assert "metrics" in paths and "runtime.lean_p2p" in paths and "optimizer.lr" in paths
    unset = [path for path in paths if _option_of(path, named) is None and path not in SET_OTHERWISE]
    assert unset == [], f"settings without a launch option: {unset} (add the option, or list it in SET_OTHERWISE)"
    stale = [path for path in SET_OTHERWISE if path not in paths or _option_of(path, named) is not None]
    assert stale == []


@pytest.mark.parametrize("path", [p for p in _setting_paths() if p not in SET_OTHERWISE])
def test_a_launch_options_default_is_the_setting_a_launch_without_it_records(path: str) -> None:
    named = _launch_parameters()
    option = _option_of(path, named)
    assert option is not None
    parameter = named[option]
    default = parameter.default
    if path in DEFAULT_BY_RULE:
        assert default is None or path in ("plan", "out"), DEFAULT_BY_RULE[path]
        return
    recorded = _value(path, launch_config(plan="p", cluster="c", out="o"))
    if option.startswith("--no-") and option not in parameter.secondary_opts:  # a switch off by its option
        default = not default
    elif option == "--metrics":
        default = parse_sinks(default)
    elif isinstance(default, Path):
        default = str(default)
    assert default == recorded, f"{option} defaults to {default!r}, a launch without it records {path} = {recorded!r}"

"""The options of `flashflex launch --elastic`, checked before anything is read or started."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .. import validate_numbers
from ..cost.params import CostParams
from ..errors import InputError

if TYPE_CHECKING:
    from ..plan.schema import Plan

MAX_RESTARTS = 1000


@dataclass(frozen=True)
class ElasticSettings:
    """The elastic options. max_restarts: re-plans after lost devices (cluster-watch re-plans not counted);
    min_devices: fewest devices worth continuing on; cluster_watch: a cluster file to watch; replan_gain_pct:
    predicted tokens/s gain (percent) a watched change needs; layers: layer profile files of the plan's
    `inputs.layer_profiles`; time_budget_s: the planner's search cap (seconds)."""

    max_restarts: int = 3
    min_devices: int = 1
    cluster_watch: str | None = None
    replan_gain_pct: float = 10.0
    layers: tuple[str, ...] = ()
    time_budget_s: float = 30.0


def elastic_options(elastic: bool, launcher: str, max_restarts: int, min_devices: int, cluster_watch: Path | None,
                    replan_gain: float, layers: list[Path] | None, checkpoint_dir: str | None) -> ElasticSettings | None:
    """The settings of an elastic launch (None without --elastic); InputError for an elastic option without
    --elastic, a launcher that cannot re-plan, no checkpoint folder (--no-checkpoint) or a number out of range."""
    if not elastic:
        given = [name for name, value in (("--cluster-watch", cluster_watch), ("--layers", layers)) if value]
        given += [name for name, value, default in (("--max-restarts", max_restarts, 3), ("--min-devices",
                  min_devices, 1), ("--replan-gain", replan_gain, 10.0)) if value != default]
        if given:
            raise InputError(f"{', '.join(given)} need(s) --elastic")
        return None
    if launcher not in ("local", "torchrun"):
        raise InputError(f"--elastic works with --launcher local or torchrun; --launcher {launcher} is not supported")
    if launcher != "local" and (cluster_watch is not None or layers):
        raise InputError("--cluster-watch and --layers work with the local launcher only")
    if checkpoint_dir is None:
        raise InputError("--elastic needs checkpoints, not --no-checkpoint (a lost device is survived from the last "
                         "checkpoint)")
    validate_numbers.int_in_range(max_restarts, "--max-restarts", 0, MAX_RESTARTS)
    validate_numbers.int_in_range(min_devices, "--min-devices", 1, 1_000_000)
    validate_numbers.non_negative(replan_gain, "--replan-gain")
    if cluster_watch is not None and not cluster_watch.is_file():
        raise InputError(f"--cluster-watch {cluster_watch}: no such file")
    return ElasticSettings(max_restarts=max_restarts, min_devices=min_devices,
                           cluster_watch=str(cluster_watch) if cluster_watch else None,
                           replan_gain_pct=float(replan_gain), layers=tuple(str(p) for p in layers or ()))


def check_elastic_plan(plan: Plan, settings: ElasticSettings | None) -> None:
    """Before anything starts: the layer profiles a re-plan needs are among --layers (InputError otherwise)."""
    if settings is None:
        return
    cost_params(plan, settings.layers)


def cost_params(plan: Plan, layers: tuple[str, ...]) -> CostParams:
    """The cost parameters to re-plan `plan` with: the layer profiles its `inputs.layer_profiles` name, found
    among `layers` by sha256 (InputError naming the missing ones). Other cost overrides are not recorded in a
    plan: re-planning uses the defaults, on the runtime paths the plan was predicted for."""
    params = CostParams().for_launch(plan.inputs.runtime_options())
    wanted = set(plan.inputs.layer_profiles or ())
    if not wanted:
        return params
    from ..layers.load import load_layer_profiles

    profiles = load_layer_profiles(list(layers)) if layers else ()
    chosen = tuple(p for p in profiles if p.sha256() in wanted)
    missing = wanted - {p.sha256() for p in chosen}
    if missing:
        raise InputError(f"the plan was costed with layer profile(s) {', '.join(sorted(m[:12] for m in missing))}, "
                         "not among --layers: pass the same files so that re-planning is costed as the plan was")
    return params.with_layer_profiles(chosen)

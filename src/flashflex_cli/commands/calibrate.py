"""CLI command: `flashflex calibrate RUN_DIR` (layer profiles fitted from a finished run; runs/calibrate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from .cluster_input import load_cluster_warned
from .consoles import results, wrote


def _targets(profiles: list, out: Path | None, out_dir: Path | None) -> list[Path]:
    """Where each profile goes: --out FILE for a run of one device type, --out-dir DIR/<type>.layers.json."""
    from ..errors import InputError

    if (out is None) == (out_dir is None):
        raise InputError("pass exactly one of --out FILE and --out-dir DIR")
    if out is not None:
        if len(profiles) > 1:
            types = ", ".join(p.device_type for p in profiles)
            raise InputError(f"the run used {len(profiles)} device types ({types}): pass --out-dir DIR "
                             "(one file per type)")
        return [out]
    assert out_dir is not None
    return [out_dir / f"{p.device_type.lower().replace('/', '_')}.layers.json" for p in profiles]


def calibrate_command(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A finished run folder (flashflex launch --out)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Layer profile to write (a run of one device type)."),
    out_dir: Path | None = typer.Option(None, "--out-dir", help="Folder for one <type>.layers.json per device type."),
    plan_file: Path | None = typer.Option(None, "--plan", help="The run's plan (default: RUN_DIR/plan.json)."),
    cluster_file: Path | None = typer.Option(None, "--cluster", "-c",
                                             help="The run's cluster (default: RUN_DIR/cluster.json)."),
    json_out: bool = typer.Option(False, "--json", help="Print the files written and the per-stage fits as JSON."),
    layers: Path | None = typer.Option(
        None, "--layers", help="A measured layer profile (flashflex profile --model) to scale by what the run "
        "measured against it, instead of fitting entries at the run's micro-batch size and TP degree only."),
) -> None:
    """Fit per-layer forward/backward seconds per device type from a run's measured stage times and write
    them as flashflex.layers/1 profiles, for `flashflex plan/show --layers`; with --layers, write that profile
    scaled by the run (every micro-batch size and TP degree of it)."""
    from ..cost.params import CostParams
    from ..errors import InputError
    from ..layers.schema import load_layer_profile, save_layer_profile
    from ..plan.schema import load_plan
    from ..runs.calibrate import fit_profiles, scale_profile
    from ..runs.paths import params_for_run
    from ..runs.reader import load_run, require_plan_cluster

    plan = load_plan(plan_file) if plan_file is not None else None
    cluster = load_cluster_warned(cluster_file) if cluster_file is not None else None
    run = load_run(run_dir, plan=plan, cluster=cluster)
    plan, cluster = require_plan_cluster(run)
    params = params_for_run(CostParams(), run.path, plan, cluster)  # the runtime paths the run took
    if layers is not None:
        base = load_layer_profile(layers)
        scaled, r_fwd, r_bwd, fits = scale_profile(base, plan, cluster, run, params)
        profiles = [scaled]
        results(json_out).print(
            f"  {base.device_type}: the run measured forward x{r_fwd:.3f}, backward x{r_bwd:.3f} the profile")
    else:
        profiles, fits = fit_profiles(plan, cluster, run, params)
    targets = _targets(profiles, out, out_dir)
    inputs = {p.resolve() for p in run.path.iterdir()} | {run.path.resolve()}
    inputs |= {p.resolve() for p in (plan_file, cluster_file, layers) if p is not None}
    for target in targets:
        if target.resolve() in inputs:
            raise InputError(f"{target}: is an input of this command; choose another output")
    for target, profile in zip(targets, profiles, strict=True):
        save_layer_profile(target, profile)
    console = results(json_out)
    table = Table(title=f"per-layer fit from {run_dir} ({len(run.used_rows)} steps, warm-up left out)",
                  title_justify="left")
    for name in ("stage", "type", "mbs", "tp", "layers", "slowdown", "fwd/mb measured", "layer fwd", "layer bwd"):
        table.add_column(name, justify="left" if name in ("stage", "type") else "right")
    for f in fits:
        table.add_row(f"p{f.pipeline}.s{f.stage}", f.device_type, str(f.micro_batch_size), str(f.tp), str(f.layers),
                      f"{f.slowdown:g}", f"{1e3 * f.measured_fwd_s:.2f} ms", f"{1e3 * f.layer.fwd_s:.3f} ms",
                      f"{1e3 * f.layer.bwd_s:.3f} ms")
    console.print(table)
    for target in targets:
        wrote(console, target, indent="  ")
    if json_out:
        typer.echo(json.dumps({
            "profiles": [str(t) for t in targets],
            "stages": [{"pipeline": f.pipeline, "stage": f.stage, "device_type": f.device_type,
                        "micro_batch_size": f.micro_batch_size, "tp": f.tp, "layers": f.layers,
                        "slowdown": f.slowdown, "measured_fwd_s": f.measured_fwd_s, "measured_bwd_s": f.measured_bwd_s,
                        "layer": f.layer.model_dump(), "embedding": f.embedding.model_dump(),
                        "head": f.head.model_dump()} for f in fits]}, indent=2))


def register(app: typer.Typer) -> None:
    """Add `calibrate` to the root app."""
    app.command("calibrate")(calibrate_command)

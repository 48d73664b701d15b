"""CLI commands: `flashflex plan`, `flashflex show`, `flashflex diff` (thin: parse, call, render)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import typer

from .. import validate_numbers
from ..cost.estimate import estimate
from ..cost.params import CostParams
from ..cost.reestimate import reestimated, unmatched_profiles, validate_plan
from ..errors import CheckFailed, FlashflexError, InputError
from ..fileio import atomic_write_text, check_writable_output, read_json, refuse_same_path
from ..hardware.cluster import Cluster
from ..layers.load import check_profile_fits, load_layer_profiles
from ..model.hf_config import resolve_model
from ..model.spec import ModelSpec
from ..plan.diff import diff_plans
from ..plan.render import render_baseline, render_diff, render_plan
from ..plan.schema import Plan, PlannedPaths, TrainConfig, load_plan
from ..planner.fleet.economics import annotated
from ..planner.fleet.precision import AUTO, AUTO_DTYPES, DTYPE_CHOICES, DtypeTrial, choose_dtype
from ..semantics.runtime_paths import RuntimeOptions
from . import runtime_switches as switches
from .cluster_input import load_cluster_warned
from .consoles import diagnostics, results, wrote
from .plan_objective import PRICES_HELP, Fleet, device_prices

LAYERS_HELP = "Measured layer profile (flashflex.layers/1); repeatable. Stages it matches are costed from it."


def read_cost_params(path: Path | None, layers: list[Path] | None = None, plan: Plan | None = None,
                 model: ModelSpec | None = None, train: TrainConfig | None = None,
                 dtypes: tuple[str, ...] = ()) -> CostParams:
    """Defaults, `path`'s overrides, and the layer profiles of `layers`, each of which must describe the
    plan's (or `model`/`train`'s) model shape and settings; a profile in one of `dtypes` (those --dtype auto
    weighs) is checked against `train` in its own dtype."""
    params = CostParams()
    if path is not None:
        data = read_json(path)
        if not isinstance(data, dict):
            raise InputError(f"{path}: expected a JSON object of cost parameter overrides")
        try:
            params = CostParams.from_overrides(data)
        except InputError as exc:
            raise InputError(f"{path}: {exc}") from None
    if layers:
        profiles = load_layer_profiles(layers)
        if plan is not None:
            model, train = plan.inputs.model, plan.inputs.train
        if model is not None and train is not None:
            for path_, profile in zip(layers, profiles, strict=True):
                own = train.model_copy(update={"dtype": profile.dtype}) if profile.dtype in dtypes else train
                check_profile_fits(path_, profile, model, own)
        params = params.with_layer_profiles(profiles)
    return params


def _train(global_batch: int, seq_len: int, dtype: str, recompute: bool,
           attention: str = "sdpa") -> TrainConfig:
    from pydantic import ValidationError

    from ..fileio import validation_message

    try:
        return TrainConfig(global_batch=global_batch, seq_len=seq_len, dtype=dtype,
                           recompute=recompute, attention=attention)
    except ValidationError as exc:
        raise InputError(validation_message("options", exc)) from None


def plan_command(
    cluster_file: Path = typer.Argument(..., metavar="CLUSTER.json", help="Cluster profile (flashflex.cluster/1)."),
    model: str = typer.Option(..., "--model", "-m", help="Model preset (e.g. llama2-7b) or a HF config.json."),
    global_batch: int = typer.Option(..., "--global-batch", "-b", help="Sequences per optimizer step."),
    seq_len: int = typer.Option(..., "--seq-len", "-s", help="Tokens per sequence."),
    micro_batch: int | None = typer.Option(None, "--micro-batch", help="Sequences per micro-batch (pins it; "
                                           "default: searched per pipeline up to --max-micro-batch)."),
    max_micro_batch: int = typer.Option(8, "--max-micro-batch", help="Largest micro-batch searched (1-1024)."),
    jobs: int = typer.Option(0, "--jobs", help="Planner worker processes (0: every usable core)."),
    strategy: str = typer.Option("flashflex", "--strategy", help="flashflex, uniform or exhaustive (<= 12 devices)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Plan file to write (atomically)."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON on stdout (nothing else there)."),
    time_budget: float = typer.Option(30.0, "--time-budget", min=0.0, help="Search time cap in seconds."),
    seed: int = typer.Option(0, "--seed", help="Seed for METIS and the refinement order."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16, fp32, tf32 (fp32 tensors, TF32 matmuls) or "
                              "auto (bf16 where every device computes it natively, else the better of bf16 and fp16)."),
    recompute: bool = typer.Option(False, "--recompute/--no-recompute", help="Full activation recompute."),
    attention: str = typer.Option("sdpa", "--attention", help="flash, sdpa or eager (keeps s x s scores)."),
    cost_params: Path | None = typer.Option(None, "--cost-params", help="JSON file of CostParams overrides."),
    layers: list[Path] | None = typer.Option(None, "--layers", help=LAYERS_HELP),
    baseline: bool = typer.Option(True, "--baseline/--no-baseline", help="Also plan the uniform baseline."),
    prices_file: Path | None = typer.Option(None, "--prices", help=PRICES_HELP),
    objective: str = typer.Option("throughput", "--objective",
                                  help="throughput (most tokens/s) or cost (least money per token; needs --prices)."),
    budget: float | None = typer.Option(None, "--budget", metavar="PER_HOUR",
                                        help="Most tokens/s whose devices cost at most this per hour (--prices)."),
    exclude: str | None = typer.Option(None, "--exclude", metavar="NODES", help="Nodes not to plan on: node3,node5."),
    explain_groups: bool = typer.Option(False, "--explain", help="Per node group: drop it, re-plan, and print "
                                        "what it adds in tokens/s and costs (with --prices)."),
    lean_p2p: bool | None = switches.LEAN_P2P,
    overlap_dp: bool | None = switches.OVERLAP_DP,
    hierarchical_dp: bool | None = switches.HIERARCHICAL_DP,
    compile_: bool | None = switches.COMPILE,
    chunked_loss: bool | None = switches.CHUNKED_LOSS,
    optimizer: str | None = switches.OPTIMIZER,
    cast_once: bool | None = switches.CAST_ONCE,
    shard_optimizer: str = typer.Option("auto", "--shard-optimizer", help="Shard the fp32 master weights and "
                                        "AdamW moments across each slice's data-parallel holders: auto (where it "
                                        "predicts faster), on or off."),
    sync: str = typer.Option("auto", "--sync", help="full (synchronous data parallelism), local (replica groups "
                             "cut along slow links, joined by outer steps: DiLoCo) or auto (local only where the "
                             "cost model predicts it much faster)."),
    inner_steps: str = typer.Option("16:500", "--inner-steps", metavar="MIN:MAX",
                                    help="Range of H, the inner steps per round of local sync."),
) -> None:
    """Plan an asymmetric DP x PP x TP layout and print its predicted throughput next to the uniform one."""
    from ..planner.search import SearchStats, plan_layout, searches_of
    from ..planner.search.pool import usable_cores
    from ..planner.search.replica_groups import SYNC_CHOICES, choose_sync, parse_inner_steps
    from ..planner.search.sharding import MODES as SHARDING_MODES
    from ..planner.search.sharding import choose_sharding

    if out is not None:
        check_writable_output(out)
        refuse_same_path(out, [cluster_file, cost_params, prices_file, *(layers or [])])
    validate_numbers.seed(seed)
    validate_numbers.int_in_range(max_micro_batch, "--max-micro-batch", 1, 1024)
    validate_numbers.int_in_range(jobs, "--jobs", 0, 256)
    validate_numbers.batch_shape(global_batch, seq_len, 1 if micro_batch is None else micro_batch)
    if dtype not in DTYPE_CHOICES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if shard_optimizer not in SHARDING_MODES:
        raise InputError(f"--shard-optimizer must be one of {', '.join(SHARDING_MODES)}, got {shard_optimizer!r}")
    if sync not in SYNC_CHOICES:
        raise InputError(f"--sync must be one of {', '.join(SYNC_CHOICES)}, got {sync!r}")
    steps_range = parse_inner_steps(inner_steps)
    runtime = switches.switched(RuntimeOptions(), switches.given_switches(
        lean_p2p, overlap_dp, hierarchical_dp, compile_, chunked_loss, optimizer, cast_once))
    cluster = load_cluster_warned(cluster_file)
    spec = resolve_model(model)
    dtypes = AUTO_DTYPES if dtype == AUTO else (dtype,)
    train = _train(global_batch, seq_len, dtypes[0], recompute, attention)
    params = read_cost_params(cost_params, layers, model=spec, train=train, dtypes=dtypes).for_launch(runtime)
    options = Fleet.from_options(cluster, prices_file, objective, budget, exclude)
    stats = SearchStats()
    fleets: list[Fleet] = []  # one per dtype planned (two at most, with --dtype auto)

    sharding_why: list[str] = []  # the last search's sharding decision, printed with the plan

    def sharded_in(plan_with: Callable[[int], Plan]) -> Plan:
        found, why = choose_sharding(plan_with, shard_optimizer, params)
        sharding_why[:] = [why]
        return found

    def plan_in(chosen: str) -> DtypeTrial:
        """The fleet planned in dtype `chosen`, re-estimated on the whole cluster."""
        fleet, trained = replace(options), train.model_copy(update={"dtype": chosen})
        fleets.append(fleet)
        found = fleet.plan(lambda sub: sharded_in(searches_of(
            sub, spec, trained, strategy=strategy, time_budget_s=time_budget, seed=seed,
            params=params, stats=stats, max_micro_batch=max_micro_batch if micro_batch is None else None,
            jobs=jobs or usable_cores(), micro_batch=micro_batch or 1)))
        found = reestimated(found, estimate(found, cluster, params))  # records the layer profiles it used
        assert fleet.choice is not None  # fleet.plan raises otherwise
        return DtypeTrial(chosen, found, float(found.predicted.tokens_per_s),  # type: ignore[union-attr]
                          fleet.choice.best.per_million_tokens, payload=fleet)

    reason = None
    if dtype == AUTO:
        allowed = [d for d in cluster.device_ids if cluster.node_of(d) in options.allowed]
        trial, reason = choose_dtype(cluster, allowed, plan_in, objective,
                                     options.prices.currency if options.prices is not None else "")
    else:
        trial = plan_in(dtype)
    assert trial.plan is not None and isinstance(trial.payload, Fleet)
    plan, fleet, train = trial.plan, trial.payload, trial.plan.inputs.train
    # where `flashflex launch` finds the cluster when --cluster is not given (the sha256 is still checked)
    # and the runtime switches it was predicted for (none for the launch defaults)
    # and the sharding mode an elastic re-plan repeats (none for auto, the default)
    mode = None if shard_optimizer == "auto" else shard_optimizer
    recorded = plan.inputs.model_copy(update={"cluster_path": str(cluster_file), "dtype_reason": reason,
                                              "runtime": PlannedPaths.of(runtime), "shard_optimizer": mode})
    plan = plan.model_copy(update={"inputs": recorded})
    plan = fleet.finish(plan, params)  # measured idle reasons, MFU over the whole cluster, dollars
    plan = choose_sync(sync, plan, cluster, lambda sub, trained: plan_layout(  # replica groups (issue 32)
        sub, spec, trained, strategy=strategy, time_budget_s=time_budget, seed=seed, params=params,
        max_micro_batch=max_micro_batch if micro_batch is None else None, jobs=jobs or usable_cores(),
        micro_batch=micro_batch or 1), params, steps_range)
    if out is not None:
        atomic_write_text(out, plan.to_json())
    if json_out:
        typer.echo(plan.to_json(), nl=False)
    console, warn = results(json_out), diagnostics()
    for line in unmatched_profiles(estimate(plan, cluster, params), params, cluster) if params.layer_profiles else ():
        warn.print(f"[yellow]warning[/yellow]: {line}", soft_wrap=True)
    render_plan(console, plan)
    if plan.optimizer_sharding is None:  # a sharded plan says why in its own lines
        for line in sharding_why:
            console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    uniform, why = None, ""
    if baseline and strategy != "uniform":
        try:
            uniform = fleet.baseline(plan_layout(fleet.baseline_cluster(), spec, train, strategy="uniform",
                                                 seed=seed, params=params, micro_batch=micro_batch or 1))
        except FlashflexError as exc:
            why = str(exc)
    if strategy != "uniform":
        render_baseline(console, plan, uniform, why)
    stats.seconds = max(stats.seconds, sum(f.seconds for f in fleets))  # every re-plan of the objective search
    console.print(f"  searched {stats.candidates} layouts, estimated {stats.estimated}, in {stats.seconds:.2f} s"
                  + (" (time budget reached: the result may depend on machine speed)" if stats.budget_hit else ""))
    fleet.render(console, explain_groups)
    if out is not None:
        wrote(console, out, indent="  ")


def show_command(
    plan_file: Path | None = typer.Argument(None, metavar="PLAN.json|RUN", help="Plan file (flashflex.plan/1), or "
                                            "a run folder: its own plan against its measurements (as --run RUN)."),
    cluster_file: Path | None = typer.Option(None, "--cluster", "-c",
                                             help="Validate against this cluster and re-estimate."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan (re-estimated with --cluster) as JSON."),
    cost_params: Path | None = typer.Option(None, "--cost-params", help="JSON file of CostParams overrides."),
    layers: list[Path] | None = typer.Option(None, "--layers", help=LAYERS_HELP),
    run_dir: Path | None = typer.Option(None, "--run", help="A run folder of this plan (flashflex launch --out): "
                                        "predicted and measured per stage side by side."),
    timeline: Path | None = typer.Option(None, "--timeline", help="Draw the 1F1B schedules (predicted, and "
                                         "measured with --run) to this PNG (needs matplotlib)."),
    prices_file: Path | None = typer.Option(None, "--prices", help="With --cluster: " + PRICES_HELP),
    lean_p2p: bool | None = switches.LEAN_P2P,
    overlap_dp: bool | None = switches.OVERLAP_DP,
    hierarchical_dp: bool | None = switches.HIERARCHICAL_DP,
    compile_: bool | None = switches.COMPILE,
    chunked_loss: bool | None = switches.CHUNKED_LOSS,
    optimizer: str | None = switches.OPTIMIZER,
    cast_once: bool | None = switches.CAST_ONCE,
) -> None:
    """Render a plan; with --cluster, validate it there and predict it afresh (exit 1 if it cannot run); with
    --run, side by side with what a run of it measured."""
    plan_file, run_dir = _plan_and_run(plan_file, run_dir)
    if prices_file is not None and cluster_file is None and run_dir is None:
        raise InputError("--prices needs --cluster (prices are per device type; the cluster names the types)")
    given = switches.given_switches(lean_p2p, overlap_dp, hierarchical_dp, compile_, chunked_loss, optimizer,
                                    cast_once)
    if given and run_dir is not None:
        raise InputError(f"{switches.flags_text(given)} and --run contradict each other: a run is predicted by the "
                         "paths it recorded (RUN/runtime.json)")
    if given and cluster_file is None and timeline is None:  # predict afresh on the cluster the plan was made for
        from ..launch.recorded_cluster import recorded_cluster_path

        cluster_file = recorded_cluster_path(plan_file)
    plan = load_plan(plan_file)
    runtime = switches.switched(plan.inputs.runtime_options(), given)
    params = read_cost_params(cost_params, layers, plan)  # read and checked with or without --cluster, as plan does
    console, warn = results(json_out), diagnostics()
    if run_dir is not None:
        from ..launch.lock import stale_lock_note

        if (note := stale_lock_note(run_dir)) is not None:
            warn.print(note, markup=False, soft_wrap=True)
    if run_dir is not None or timeline is not None:
        from ..runs.show import cluster_for_run

        cluster_file = cluster_for_run(cluster_file, run_dir)
    if cluster_file is not None:
        cluster = load_cluster_warned(cluster_file)
        prices = device_prices(prices_file, cluster)
        if run_dir is not None:  # predict the run by the runtime paths it took
            from ..runs.paths import params_for_run

            params = params_for_run(params, run_dir, plan, cluster)
        else:  # the launch the plan was predicted for, or the one the switches describe
            params = params.for_launch(runtime)
            plan = plan.model_copy(update={"inputs": plan.inputs.model_copy(
                update={"runtime": PlannedPaths.of(runtime)})})
        result = validate_plan(plan, cluster, params)
        for line in result.warnings:
            warn.print(f"[yellow]warning[/yellow]: {line}", soft_wrap=True)
        if result.estimate is not None:
            found = reestimated(plan, result.estimate)
            if plan.outer_sync is not None:  # replica groups: the round (cost/outer_sync.py), not one step
                from ..cost.outer_sync import round_predicted
                from ..plan.predicted import Predicted

                found = found.model_copy(update={"predicted": Predicted.model_validate(
                    round_predicted(plan, cluster, params))})
            plan = annotated(found, cluster, prices)
        compared = None
        if run_dir is not None or timeline is not None:
            from ..runs.show import plan_json_with_run, render_run, run_views

            compared = run_views(console, plan, result.estimate, run_dir, timeline)
        if json_out:
            typer.echo(plan.to_json() if compared is None else plan_json_with_run(plan, compared), nl=False)
        render_plan(console, plan)
        if compared is not None:
            render_run(console, compared)
        if not result.ok:
            raise CheckFailed(f"{plan_file} does not fit cluster {cluster.name!r}: " + "; ".join(result.errors))
        return
    if json_out:
        typer.echo(plan.to_json(), nl=False)
    render_plan(console, plan)


def _plan_and_run(plan_file: Path | None, run_dir: Path | None) -> tuple[Path, Path | None]:
    """`show`'s plan file and run folder: a run folder given as PLAN is --run RUN with RUN/plan.json; --run
    alone shows RUN/plan.json (InputError when neither names a plan)."""
    from ..semantics.run_folder import PLAN_COPY, is_run_folder

    if plan_file is not None and plan_file.is_dir() and is_run_folder(plan_file):
        if run_dir is not None and run_dir.resolve() != plan_file.resolve():
            raise InputError(f"{plan_file} is a run folder and --run names another one ({run_dir})")
        run_dir = plan_file
        plan_file = None
    if plan_file is None:
        if run_dir is None:
            raise InputError("show needs PLAN.json or a run folder (flashflex show RUN, or show PLAN.json --run RUN)")
        plan_file = run_dir / PLAN_COPY
        if not plan_file.is_file():
            raise InputError(f"{run_dir}: no {PLAN_COPY} (a run folder of `flashflex launch`?); name the plan: "
                             f"flashflex show PLAN.json --run {run_dir}")
    return plan_file, run_dir


def _predicted_on(plan: Plan, cluster: Cluster, cost_params: Path | None, layers: list[Path] | None) -> Plan:
    """`plan` with its prediction made afresh on `cluster` (its checks' errors as one InputError)."""
    params = read_cost_params(cost_params, layers, plan).for_launch(plan.inputs.runtime_options())
    result = validate_plan(plan, cluster, params)
    if result.estimate is None:
        raise InputError("; ".join(result.errors))
    return reestimated(plan, result.estimate)


def diff_command(
    plan_a: Path = typer.Argument(..., metavar="A.json", help="The reference plan."),
    plan_b: Path = typer.Argument(..., metavar="B.json", help="The new plan."),
    fail_on_regression: float | None = typer.Option(
        None, "--fail-on-regression", metavar="PCT",
        help="Exit 1 when B's predicted tokens/s is more than PCT percent below A's (PCT >= 0), or unknown."),
    json_out: bool = typer.Option(False, "--json", help="Print the diff as JSON on stdout."),
    cluster_file: Path | None = typer.Option(
        None, "--cluster", "-c", help="Predict both plans afresh on this cluster before comparing."),
    cost_params: Path | None = typer.Option(None, "--cost-params", help="With --cluster: CostParams overrides."),
    layers: list[Path] | None = typer.Option(None, "--layers", help="With --cluster: " + LAYERS_HELP),
    prices_file: Path | None = typer.Option(None, "--prices", help="With --cluster: " + PRICES_HELP),
) -> None:
    """Structural changes and predicted-metric deltas from plan A to plan B (as written, or predicted afresh
    on --cluster with --layers profiles)."""
    import json

    from ..validate_numbers import non_negative

    if fail_on_regression is not None:
        non_negative(fail_on_regression, "--fail-on-regression")
    if cluster_file is None and (layers or cost_params is not None or prices_file is not None):
        raise InputError("--layers, --cost-params and --prices need --cluster (diff compares the plans' own "
                         "predictions otherwise)")
    a, b = load_plan(plan_a), load_plan(plan_b)
    if cluster_file is not None:
        cluster = load_cluster_warned(cluster_file)
        prices = device_prices(prices_file, cluster)
        a, b = (annotated(_predicted_on(plan, cluster, cost_params, layers), cluster, prices) for plan in (a, b))
    result = diff_plans(a, b)
    if json_out:
        typer.echo(json.dumps(result.to_json(), indent=2))
    render_diff(results(json_out), result, str(plan_a), str(plan_b))
    if fail_on_regression is not None:
        drop = result.regression_pct()
        if drop is None:
            raise CheckFailed("cannot check for a regression: a plan has no finite predicted tokens_per_s "
                              "(re-run `flashflex show PLAN --cluster CLUSTER --json`)")
        if drop > fail_on_regression:
            raise CheckFailed(f"predicted tokens/s fell {drop:.2f}% ({result.metric('tokens_per_s').a:,.0f} -> "
                              f"{result.metric('tokens_per_s').b:,.0f}), more than the allowed {fail_on_regression:g}%")


def register(app: typer.Typer) -> None:
    """Add `plan`, `show` and `diff` to the root app."""
    app.command("plan")(plan_command)
    app.command("show")(show_command)
    app.command("diff")(diff_command)

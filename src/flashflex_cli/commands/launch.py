"""CLI command: `flashflex launch PLAN` (run locally, or render torchrun / SLURM launch scripts)."""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from ..errors import InputError
from ..fileio import atomic_write_text, check_writable_dir, check_writable_output, refuse_same_path
from ..launch.elastic_options import ElasticSettings, check_elastic_plan, elastic_options
from ..launch.gpu_subset import check_gpus
from ..launch.options import DEFAULT_CHECKPOINT_EVERY, DEFAULT_LR, checkpoint_folder, launch_config
from ..launch.preflight import check_run_dirs, start_decision
from ..launch.recorded_cluster import recorded_cluster_path
from ..launch.share_gpu import check_share_gpu
from ..run_config import RunConfig, save_run_config
from ..semantics.metrics_sinks import DEFAULT_SINKS, check_packages, parse_sinks
from ..semantics.run_folder import (
    METRICS,
    RUNTIME_RECORD,
    clear_progress,
    latest_rows,
    launch_index,
    metric_rows,
)
from ..semantics.runtime_paths import RuntimeOptions
from ..validate_numbers import port as port_number
from . import runtime_switches as switches
from .cluster_input import load_cluster_warned
from .consoles import wrote

if TYPE_CHECKING:
    from ..plan.schema import Plan

LAUNCHERS = ("local", "torchrun", "slurm")


def _split(text: str | None, what: str) -> tuple[str, ...] | None:
    """A comma-separated list of names; an empty name (",,", a trailing comma, "") is refused."""
    if text is None:
        return None
    parts = tuple(part.strip() for part in text.split(","))
    if not all(parts):
        raise InputError(f"{what} {text!r}: empty name in the comma-separated list")
    return parts


def _host_addresses(hosts: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """--hosts entries, each a host name or IP address (hostnames.py), else one line naming the entry."""
    from ..hostnames import host_problem
    from ..physical_limits import shown

    for host in hosts or ():
        problem = host_problem(host)
        if problem is not None:
            raise InputError(f"--hosts entry {shown(host)} {problem}")
    return hosts


def _script_inputs(plan_path: Path, cluster_path: Path, data: str, template: str | None) -> list[str | Path]:
    """Files a rendered script must not overwrite."""
    inputs: list[str | Path] = [plan_path, cluster_path]
    if data != "synthetic":
        inputs.append(data)
    if template is not None:
        inputs.append(template)
    return inputs


def _check_outputs(launcher: str, script: Path | None, options: RunConfig, inputs: list[str | Path],
                   dry_run: bool) -> None:
    """Before anything is read: the script file can be written and is no input; a local run's folders can
    be created and written; the run configuration (RUN/config.json, not written by a dry run) is no input or
    script, and a rendering's run folder can be written."""
    if script is not None:
        check_writable_output(script, "--script")
        refuse_same_path(script, inputs, "--script")
    if launcher == "local":
        check_run_dirs(options.out, options.checkpoint_dir)
    elif not dry_run:
        check_writable_dir(options.out, "--out")
    if not dry_run:  # an --init-from folder has a config.json of its own
        hf_config = Path(options.init_from) / "config.json" if options.init_from else None
        refuse_same_path(options.path, [*inputs, script, hf_config], "the run configuration")


def _run_here(plan: Plan, plan_path: Path, options: RunConfig, lock_fds: tuple[int, ...], console: Console,
              elastic: ElasticSettings | None = None) -> None:
    """Run every rank on this host (re-planning on lost devices with `elastic`); a stop signal ends with one
    line saying whether a checkpoint was written (not an error line) and exit code 128 + the signal."""
    from ..launch.failures import Interrupted
    from ..launch.local import launch_local

    console.print(f"launching {plan.world_size} ranks of {plan_path} on this host: {options.steps} steps, "
                  f"data {options.data}" + (" (elastic)" if elastic else ""), markup=False)
    try:
        if elastic is not None:
            from ..launch.elastic import run_elastic

            run_elastic(plan, options, elastic, lock_fds, lambda line: console.print(line, markup=False))
        else:
            launch_local(plan, options, inherit_fds=lock_fds)
    except Interrupted as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(exc.exit_code) from None


def _say_planned_paths(console: Console, plan: Plan, given: dict[str, object]) -> None:
    """One line when the plan's recorded runtime switches (`flashflex plan --no-compile ...`) set paths that the
    command line did not."""
    from ..semantics.runtime_paths import switch_flag

    recorded = plan.inputs.runtime
    if recorded is None:
        return
    options = recorded.options()
    taken = [switch_flag(name, getattr(options, name)) for name in type(recorded).model_fields
             if name not in given and getattr(options, name) != getattr(RuntimeOptions(), name)]
    if taken:
        console.print(f"runtime switches the plan was predicted for: {' '.join(taken)}", markup=False)


def _print_result(as_json: bool, summary: dict[str, object], lines: list[str]) -> None:
    """The launch's result on stdout: its JSON summary with --json (the lines then on stderr), else the lines;
    warnings on stderr."""
    if as_json:
        typer.echo(json.dumps(summary))
    for line in lines:
        typer.echo(line, err=as_json or line.startswith("warning:"))


def local_run_summary(plan: Plan, options: RunConfig, first_launch: int,
                      wall_s: float) -> tuple[dict[str, object], list[str]]:
    """After a local launch: its JSON summary and the lines of runtime/metrics.run_summary, from the metrics rows
    the launch wrote (launch index `first_launch` on: an elastic launch restarts its workers) and the run folder."""
    from ..runtime.training.metrics import predicted_step_seconds, run_summary
    from ..semantics.run_folder import latest_checkpoint

    metrics = Path(options.out) / METRICS
    rows = latest_rows([row for row in metric_rows(metrics) if row.get("launch", 0) >= first_launch])
    found = latest_checkpoint(options.checkpoint_dir) if options.checkpoint_dir else None
    compile_s = None
    try:
        compile_s = json.loads((Path(options.out) / RUNTIME_RECORD).read_text(encoding="utf-8")).get(
            "compile_warmup_s")
    except (OSError, ValueError, AttributeError):
        pass
    lines = run_summary(rows, options.steps, wall_s, predicted_step_seconds(plan.predicted), compile_s,
                        None if found is None else str(found), metrics)
    summary: dict[str, object] = {"launcher": "local", "run_dir": options.out, "metrics": str(metrics),
                                  "steps_trained": len(rows), "wall_s": round(wall_s, 3),
                                  "checkpoint": None if found is None else str(found)}
    if rows:
        summary["final_loss"] = rows[-1]["loss"]
    return summary, lines


def launch_command(
    plan_path: Path = typer.Argument(..., metavar="PLAN.json", help="A plan made by `flashflex plan`."),
    cluster_path: Path | None = typer.Option(None, "--cluster", "-c", help="The cluster file the plan was made "
                                             "for (default: the file the plan records, sha256 checked)."),
    steps: int = typer.Option(10, "--steps", help="Optimizer steps to train (in total, counting resumed ones)."),
    data: str = typer.Option("synthetic", "--data", help="A token file from `flashflex data prepare`, or synthetic."),
    out: Path = typer.Option(Path("runs/run"), "--out", help="Run folder: its configuration, metrics and checkpoints "
                               "(RUN/checkpoints); launched again, it continues or refuses, never starts over."),
    schedule_steps: int | None = typer.Option(None, "--schedule-steps", help="Length of the learning-rate "
                                              "schedule (default: --steps); keep it fixed across stops and resumes."),
    seed: int = typer.Option(0, "--seed", help="Seed of the initial weights and of the data order."),
    lr: float = typer.Option(DEFAULT_LR, "--lr", help="Peak learning rate (AdamW, warm-up then cosine)."),
    checkpoint_dir: Path | None = typer.Option(None, "--checkpoint-dir", help="Folder of checkpoints (default: "
                                               "RUN/checkpoints)."),
    checkpoint_every: int | None = typer.Option(None, "--checkpoint-every", help="Save every K steps, and at the "
                                                f"end and on a stop signal (default {DEFAULT_CHECKPOINT_EVERY}; 0: "
                                                "only at the end and on a stop signal)."),
    no_checkpoint: bool = typer.Option(False, "--no-checkpoint", help="Save no checkpoint at all (a stopped run "
                                       "cannot be continued)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint, whatever plan and "
                                "settings wrote it (the same plan and settings continue without it)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start again in a run folder that holds progress: "
                                   "its metrics and checkpoints are removed first."),
    init_from: Path | None = typer.Option(None, "--init-from", help="Initial weights from a local Hugging Face "
                                          "checkpoint folder (config.json + *.safetensors) of the plan's model."),
    timeout: float = typer.Option(60.0, "--timeout", help="Collective timeout of the steps in seconds: survivors "
                                  "of a dead rank exit after at most this long."),
    setup_timeout: float | None = typer.Option(None, "--setup-timeout", help="Collective timeout in seconds of "
                                               "set-up, compile warm-up, checkpoint load, the first step and "
                                               "checkpoint saves (default: the larger of --timeout and 600)."),
    launcher: str = typer.Option("local", "--launcher", help="local: run every rank here, supervised; torchrun: "
                                 "print one torchrun command per host; slurm: print an sbatch script."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check and print the per-node commands, start nothing "
                                 "and write nothing (not even RUN/config.json, which the commands name)."),
    hosts: str | None = typer.Option(None, "--hosts", help="Comma-separated host address per plan node "
                                     "(default: the cluster's hostnames or node names)."),
    port: int = typer.Option(29500, "--port", help="Rendezvous port on the first host."),
    ifname: str | None = typer.Option(None, "--ifname", help="Network interface of gloo and NCCL "
                                      "(GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME): one for all hosts or one per "
                                      "host, comma-separated."),
    torchrun: str = typer.Option("torchrun", "--torchrun", help="The torchrun executable in rendered commands."),
    template: str | None = typer.Option(None, "--template", help="A launcher template name or file (default: "
                                        "launchers/torchrun.sh.tmpl; slurm or slurm-hetjob)."),
    script: Path | None = typer.Option(None, "--script", help="Write the rendered script to this file."),
    job_name: str = typer.Option("flashflex", "--job-name", help="SLURM job name."),
    run_id: str = typer.Option("flashflex", "--run-id", help="Rendezvous id of rendered torchrun commands."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    elastic: bool = typer.Option(False, "--elastic", help="Survive lost devices: re-plan on the rest and resume "
                                 "from the last checkpoint (docs/elastic.md)."),
    max_restarts: int = typer.Option(3, "--max-restarts", help="With --elastic: re-plans after lost devices."),
    min_devices: int = typer.Option(1, "--min-devices", help="With --elastic: stop below this many devices."),
    cluster_watch: Path | None = typer.Option(None, "--cluster-watch", help="With --elastic: re-plan when this "
                                              "cluster file changes and the new plan pays (--replan-gain)."),
    replan_gain: float = typer.Option(10.0, "--replan-gain", metavar="PCT", help="With --cluster-watch: predicted "
                                      "tokens/s gain in percent that a re-plan needs."),
    layers: list[Path] | None = typer.Option(None, "--layers", help="With --elastic: the layer profiles the plan "
                                             "was costed with, for re-planning."),
    lean_p2p: bool | None = switches.LEAN_P2P,
    overlap_dp: bool | None = switches.OVERLAP_DP,
    hierarchical_dp: bool | None = switches.HIERARCHICAL_DP,
    compile_: bool | None = switches.COMPILE,
    chunked_loss: bool | None = switches.CHUNKED_LOSS,
    optimizer: str | None = switches.OPTIMIZER,
    cast_once: bool | None = switches.CAST_ONCE,
    loss_kernel: str | None = switches.LOSS_KERNEL,
    compile_scope: str | None = switches.COMPILE_SCOPE,
    gpus: str | None = typer.Option(None, "--gpus", metavar="LIST", help="This host's GPUs the plan's node runs "
                                    "on, e.g. 2,3 (CUDA_VISIBLE_DEVICES of the workers; local launcher)."),
    share_gpu: bool = typer.Option(False, "--share-gpu", help="Validation only, never for a real cluster: run "
                                   "every rank of a GPU plan on this machine's one GPU, each rank its own NCCL "
                                   "host talking over loopback sockets (docs/multi-gpu.md)."),
    metrics: str = typer.Option(",".join(DEFAULT_SINKS), "--metrics", metavar="LIST", help="Where the per-step "
                                "metrics go, comma-separated: jsonl (RUN/metrics.jsonl, always written), console, "
                                "tensorboard (RUN/tensorboard/), wandb (offline, RUN/wandb/)."),
) -> None:
    """Check PLAN against the cluster, the machine and the data, then run it or render its launch commands."""
    from ..launch.preflight import (
        check_checkpoint_space,
        check_init_from,
        check_local_machine,
        check_plan_cluster,
        check_run,
    )
    from ..plan.schema import load_plan

    console = Console(stderr=True, highlight=False, soft_wrap=True)
    if launcher not in LAUNCHERS:
        raise InputError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    host_list, ifnames = _host_addresses(_split(hosts, "--hosts")), _split(ifname, "--ifname") or ()
    sinks = parse_sinks(metrics)
    if launcher == "local":  # a rendered script's hosts: the worker refuses a missing package when it starts
        check_packages(sinks)
    checkpoints = checkpoint_folder(out, checkpoint_dir, checkpoint_every, no_checkpoint, resume, overwrite)
    elastic_settings = elastic_options(elastic, launcher, max_restarts, min_devices, cluster_watch, replan_gain,
                                       layers, checkpoints)
    given = switches.given_switches(lean_p2p, overlap_dp, hierarchical_dp, compile_, chunked_loss, optimizer,
                                    cast_once, loss_kernel, compile_scope)
    if cluster_path is None:
        cluster_path = recorded_cluster_path(plan_path)
    every = DEFAULT_CHECKPOINT_EVERY if checkpoint_every is None else checkpoint_every
    options = launch_config(plan=str(plan_path), cluster=str(cluster_path), out=str(out), data=data, steps=steps,
                            seed=seed, lr=lr, checkpoint_dir=checkpoints, checkpoint_every=every if checkpoints
                            else 0, resume=resume, timeout_s=timeout, setup_timeout_s=setup_timeout,
                            share_gpu=share_gpu, gpus=gpus, metrics=sinks,
                            schedule_steps=schedule_steps, init_from=str(init_from) if init_from else None,
                            runtime=given)
    if launcher != "local":
        port_number(port)
    _check_outputs(launcher, script, options, _script_inputs(plan_path, cluster_path, data, template), dry_run)
    plan, cluster = load_plan(plan_path), load_cluster_warned(cluster_path)
    # the paths the plan was predicted for, but for the switches given here
    options = dataclasses.replace(options, runtime=switches.switched(plan.inputs.runtime_options(), given))
    check_plan_cluster(plan, cluster, str(cluster_path))
    if share_gpu:
        check_share_gpu(plan, cluster, launcher, elastic)
    if options.gpu_indices is not None:
        check_gpus(plan, cluster, options.gpu_indices, launcher, share_gpu)
    check_elastic_plan(plan, elastic_settings)
    warnings = check_run(plan, data, steps, options.checkpoint_dir, options.checkpoint_every, resume,
                         options.optimizer.total_steps)
    warnings += check_init_from(plan, options.init_from, here=launcher == "local")
    if launcher == "local":
        from ..launch.local import dry_run_text
        from ..launch.lock import run_lock

        warnings += check_local_machine(plan, cluster, options.runtime, share_gpu=share_gpu,
                                        gpus=options.gpu_indices).warnings
        check_checkpoint_space(plan, options.checkpoint_dir)
        # the run folders are locked before any worker starts, while they run and until the last one ends
        with nullcontext(None) if dry_run else run_lock(options.out, options.checkpoint_dir) as lock:
            # continue, start again or refuse (one line, no warnings before it), now that no other launch can write
            # into the folders
            decision = start_decision(plan, options, overwrite)
            for line in warnings:
                console.print(f"[yellow]warning:[/] {line}")
            for note in lock.notes if lock is not None else ():
                console.print(note, markup=False)
            _say_planned_paths(console, plan, given)
            if dry_run or lock is None:
                if decision.line:
                    console.print(f"would start: {decision.line}", markup=False)
                text = dry_run_text(plan, options)
                typer.echo(json.dumps({"launcher": "local", "commands": [text]}) if as_json else text)
                return
            if decision.line:
                console.print(decision.line, markup=False)
            if decision.nothing_left:
                _print_result(as_json, {"launcher": "local", "run_dir": str(out), "steps_trained": 0}, [])
                return
            if overwrite:
                clear_progress(options.out, options.checkpoint_dir)
            options = dataclasses.replace(options, resume=decision.resume)
            first_launch, started = launch_index(Path(out) / METRICS), time.monotonic()
            _run_here(plan, plan_path, options, lock.fds, console, elastic_settings)
        summary, lines = local_run_summary(plan, options, first_launch, time.monotonic() - started)
        _print_result(as_json, summary, lines)
        return
    from ..launch.slurm import SlurmSettings, render_slurm
    from ..launch.torchrun import ElasticRender, RenderSettings, command_lines, render_torchrun

    settings = RenderSettings(hosts=host_list, port=port, ifnames=ifnames, torchrun=torchrun, run_id=run_id,
                              template=template,
                              elastic=ElasticRender(max_restarts=max_restarts) if elastic_settings else None)
    if launcher == "torchrun":
        text = render_torchrun(plan, cluster, options, settings)
    else:
        text = render_slurm(plan, cluster, options, settings, SlurmSettings(job_name=job_name))
    for line in warnings:  # after rendering, so that a refused value is the only line
        console.print(f"[yellow]warning:[/] {line}")
    _say_planned_paths(console, plan, given)
    if not dry_run:  # what every rendered worker reads; not while a local launch runs in the folder
        from ..launch.lock import run_lock

        with run_lock(options.out, None) as lock:
            decision = start_decision(plan, options, overwrite)
            for note in lock.notes:
                console.print(note, markup=False)
            if overwrite:
                clear_progress(options.out, options.checkpoint_dir)
            save_run_config(dataclasses.replace(options, resume=decision.resume))
        if decision.line:
            console.print(decision.line, markup=False)
        wrote(console, options.path)
    if script is not None:
        atomic_write_text(script, text, mode=0o777)
        wrote(console, script)
    if as_json:
        typer.echo(json.dumps({"launcher": launcher, "script": text,
                               "commands": command_lines(text) if launcher == "torchrun" else None}))
    elif script is None:
        typer.echo(text, nl=False)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the root app."""
    app.command("launch")(launch_command)

"""What `flashflex show --run RUN_DIR --timeline OUT.png` adds to `show`: the comparison and the drawing."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from ..cost.estimate import Estimate
from ..errors import InputError
from ..fileio import dumps_json
from ..plan.schema import Plan
from .compare import RunComparison, compare_run
from .reader import CLUSTER, load_run
from .render import render_comparison
from .timeline import draw_timeline, measured_ops, predicted_ops, require_matplotlib


def cluster_for_run(cluster_file: Path | None, run_dir: Path | None) -> Path:
    """--cluster, or else the run folder's copy; InputError when there is neither."""
    if cluster_file is not None:
        return cluster_file
    if run_dir is not None and (run_dir / CLUSTER).is_file():
        return run_dir / CLUSTER
    raise InputError("--run and --timeline need --cluster (or a run folder holding cluster.json)")


def run_views(console: Console, plan: Plan, est: Estimate | None, run_dir: Path | None,
              timeline: Path | None) -> RunComparison | None:
    """Compare the run (with `run_dir`) and draw the schedules (with `timeline`); everything is checked before
    the PNG is written. Returns the comparison (None without a run); prints the PNG's path."""
    if timeline is not None:
        require_matplotlib()
    if est is None:
        raise InputError("the plan could not be estimated on this cluster: nothing to compare or draw")
    run = load_run(run_dir, plan=plan) if run_dir is not None else None
    cmp = compare_run(plan, est, run) if run is not None else None
    if timeline is not None:
        inputs = {p.resolve() for p in (run.path.iterdir() if run is not None else ())}
        if timeline.resolve() in inputs:
            raise InputError(f"--timeline {timeline} would overwrite a file of the run")
        measured = measured_ops(plan, run) if run is not None else {}
        draw_timeline(timeline, plan, predicted_ops(plan, est), measured,
                      title="1F1B schedule" + (f": {run.path.name}" if run is not None else ""))
        console.print(f"  timeline: {timeline}" + ("" if measured or run is None else
                                                    " (the run recorded no per-op times: predicted only)"))
    return cmp


def render_run(console: Console, cmp: RunComparison | None) -> None:
    """Print the comparison table when there is one."""
    if cmp is not None:
        render_comparison(console, cmp)


def plan_json_with_run(plan: Plan, cmp: RunComparison | None) -> str:
    """The plan's JSON text, with a "run_comparison" object when there is a comparison."""
    if cmp is None:
        return plan.to_json()
    data = json.loads(plan.to_json())
    data["run_comparison"] = cmp.to_json()
    return dumps_json(data)

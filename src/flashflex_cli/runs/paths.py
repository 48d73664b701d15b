"""Charge a recorded run by the runtime paths it ran: RUN/runtime.json (semantics/runtime_paths.py) into the
cost parameters `show --run`, `calibrate` and the benchmarks predict it with. A run folder without the file, or
a file without a key, took the paths of the runtime before that key was recorded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..cost.memory import is_cuda_group
from ..cost.params import CostParams
from ..errors import InputError
from ..hardware.cluster import Cluster
from ..plan.schema import Plan
from ..semantics.runtime_paths import RecordedPaths, compute_dtype, from_record

RUNTIME = "runtime.json"


def recorded_paths(run_dir: str | Path, plan: Plan, cluster: Cluster) -> RecordedPaths:
    """The paths a run recorded in RUN/runtime.json (an absent file: every legacy path); InputError naming the
    file and field for a malformed one."""
    path = Path(run_dir) / RUNTIME
    record: object = {}
    if path.is_file():
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InputError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(record, dict):
        raise InputError(f"{path}: expected a JSON object of runtime paths")
    devices = [info.device for info in plan.ranks()]
    try:
        return from_record(record, plan.inputs.train.dtype, is_cuda_group(cluster, devices))
    except ValueError as exc:
        raise InputError(f"{path}: {exc}") from None


def params_for_run(params: CostParams, run_dir: str | Path, plan: Plan, cluster: Cluster) -> CostParams:
    """`params` charging the run in `run_dir` by the paths it recorded."""
    paths = recorded_paths(run_dir, plan, cluster)
    options = paths.options
    rule = compute_dtype(plan.inputs.train.dtype)
    return dataclasses.replace(params, runtime=options, dp_overlap=options.overlap_dp,
                               dp_hierarchical=options.hierarchical_dp,
                               compute_dtype=None if paths.compute_dtype == rule else paths.compute_dtype)

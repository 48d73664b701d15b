"""Load and check a run folder written by `flashflex launch --out RUN_DIR`.

RUN_DIR holds metrics.jsonl (one JSON object per step, runtime/training/metrics.py; a step redone after a resume counts by
its last row), plan.json and cluster.json (copies of what the workers ran) and timeline.jsonl (per-op times of the
last step). Measured values are medians over the steps, leaving out each launch's first (its warm-up) when there
are more.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..hardware.cluster import Cluster, load_cluster
from ..plan.schema import Plan, load_plan
from ..semantics.run_folder import CLUSTER_COPY as CLUSTER
from ..semantics.run_folder import METRICS, TIMELINE, latest_rows
from ..semantics.run_folder import PLAN_COPY as PLAN


@dataclass(frozen=True)
class RunRecord:
    """A run folder: its metrics rows (steps in order), plan and cluster (None when the folder has no copy),
    and timeline rows (empty when the run recorded none)."""

    path: Path
    rows: tuple[dict[str, Any], ...]
    plan: Plan | None
    cluster: Cluster | None
    timeline: tuple[dict[str, Any], ...]

    @property
    def used_rows(self) -> tuple[dict[str, Any], ...]:
        """The steps measured values are taken from: all but each launch's first (its warm-up: a resumed run
        compiles and fills its caches again) when that leaves any."""
        first: dict[int, int] = {}
        for row in self.rows:
            launch = int(row.get("launch", 0))
            first[launch] = min(first.get(launch, row["step"]), row["step"])
        kept = tuple(r for r in self.rows if r["step"] != first[int(r.get("launch", 0))])
        return kept or self.rows

    def step_time_s(self) -> float:
        """Median step time (seconds)."""
        return statistics.median(float(r["step_time_s"]) for r in self.used_rows)

    def stage_value(self, pipeline: int, stage: int, key: str) -> float | None:
        """Median of one per-stage field (e.g. "forward_s", seconds per step) over the used steps; None when
        the run did not record it."""
        values = [float(s[key]) for r in self.used_rows for s in r["stages"]
                  if s.get("pipeline") == pipeline and s.get("stage") == stage and key in s]
        return statistics.median(values) if values else None

    def memory_bytes(self, pipeline: int, stage: int) -> float | None:
        """Median peak memory of one stage (bytes); the run-wide largest when stages were not told apart."""
        found = self.stage_value(pipeline, stage, "memory_bytes")
        if found is not None:
            return found
        values = [float(r["memory_bytes"]) for r in self.used_rows if "memory_bytes" in r]
        return statistics.median(values) if values else None

    def rank_memory_bytes(self, pipeline: int, stage: int) -> list[float] | None:
        """Median peak memory of each TP rank of one stage (bytes, TP order); None for runs recorded before the
        per-rank figures (their stage's `memory_bytes` is the largest of its ranks)."""
        rows = [s["rank_memory_bytes"] for r in self.used_rows for s in r["stages"]
                if s.get("pipeline") == pipeline and s.get("stage") == stage and isinstance(s.get("rank_memory_bytes"),
                                                                                         list)]
        if not rows or len({len(row) for row in rows}) != 1:
            return None
        return [statistics.median(float(row[i]) for row in rows) for i in range(len(rows[0]))]

    def loss_scaling(self) -> tuple[int, int, float] | None:
        """fp16 runs: (steps recorded, steps skipped for inf/NaN gradients, the last step's loss scale); None for
        runs without loss scaling (bf16, fp32, and runs recorded before it existed)."""
        scaled = [r for r in self.rows if isinstance(r.get("loss_scale"), int | float)]
        if not scaled:
            return None
        return len(scaled), sum(1 for r in scaled if r.get("skipped") is True), float(scaled[-1]["loss_scale"])

    def stage_ops(self, pipeline: int, stage: int) -> list[tuple[str, int, float, float]]:
        """Recorded ops of one stage: (kind "F"/"B", micro-batch, start_s, end_s) since the step start."""
        for row in self.timeline:
            if row.get("pipeline") == pipeline and row.get("stage") == stage:
                return [(str(k), int(i), float(a), float(b)) for k, i, a, b in row["ops"]]
        return []


def _json_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise InputError(f"{path}:{number}: not a JSON line") from None
        if not isinstance(row, dict):
            raise InputError(f"{path}:{number}: expected a JSON object")
        rows.append(row)
    return rows


def load_run(run_dir: str | Path, plan: Plan | None = None, cluster: Cluster | None = None) -> RunRecord:
    """Load RUN_DIR; `plan` and `cluster` stand in for the folder's copies. Raises InputError (one line) for
    a missing folder, missing or empty metrics, steps without per-stage times, or stages the plan lacks."""
    path = Path(run_dir)
    if not path.is_dir():
        raise InputError(f"{path}: no such run folder")
    metrics = path / METRICS
    if not metrics.is_file():
        raise InputError(f"{path}: no {METRICS}: not a run folder of `flashflex launch`")
    rows = _json_lines(metrics)
    if not rows:
        raise InputError(f"{metrics}: holds no steps")
    for row in rows:
        if not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
            raise InputError(f"{metrics}: a row without an integer step")
        stages = row.get("stages")
        if not isinstance(stages, list) or not stages or "step_time_s" not in row:
            raise InputError(f"{metrics}: step {row.get('step', '?')} has no per-stage times")
        if any("forward_s" not in s or "backward_s" not in s for s in stages):
            raise InputError(f"{metrics}: step {row.get('step', '?')} has stages without forward_s/backward_s")
    own = load_plan(path / PLAN) if (path / PLAN).is_file() else None
    if plan is not None and own is not None:
        check_same_plan(path, own, plan)
    if cluster is None and (path / CLUSTER).is_file():
        cluster = load_cluster(path / CLUSTER)
    timeline = _json_lines(path / TIMELINE) if (path / TIMELINE).is_file() else []
    record = RunRecord(path, tuple(latest_rows(rows)), plan or own, cluster, tuple(timeline))
    if record.plan is not None:
        check_matches(record, record.plan)
    return record


def check_same_plan(run_dir: Path, ran: Plan, plan: Plan) -> None:
    """InputError unless `plan` lays out the same pipelines for the same model and training configuration as the
    plan the run's workers ran (`ran`, RUN/plan.json): measurements of another plan say nothing about this one."""
    for what, field in (("another layout", "pipelines"), ("another model", "model"),
                        ("another training configuration", "train")):
        mine = plan.model_dump(mode="json")["pipelines"] if field == "pipelines" else \
            getattr(plan.inputs, field).model_dump(mode="json")
        theirs = ran.model_dump(mode="json")["pipelines"] if field == "pipelines" else \
            getattr(ran.inputs, field).model_dump(mode="json")
        if mine != theirs:
            raise InputError(f"{run_dir} ran {what} than this plan (its own plan is {run_dir / PLAN}: compare "
                             f"with `flashflex show {run_dir / PLAN} --run {run_dir}`)")


def check_matches(run: RunRecord, plan: Plan) -> None:
    """InputError unless every stage of `plan` has measured times in `run`."""
    seen = {(s.get("pipeline"), s.get("stage")) for s in run.rows[-1]["stages"]}
    for p, pipe in enumerate(plan.pipelines):
        for s in range(len(pipe.stages)):
            if (p, s) not in seen:
                raise InputError(f"{run.path}: no measured times for pipeline {p} stage {s} of the plan")


def require_plan_cluster(run: RunRecord) -> tuple[Plan, Cluster]:
    """The run's plan and cluster, or InputError naming what is missing."""
    if run.plan is None or run.cluster is None:
        missing = " and ".join(n for n, v in ((PLAN, run.plan), (CLUSTER, run.cluster)) if v is None)
        raise InputError(f"{run.path}: no {missing} (pass --plan/--cluster for runs made before they were kept)")
    return run.plan, run.cluster

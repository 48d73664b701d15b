"""The run folder and the checkpoint folder: the names `flashflex launch`, its workers and the readers (`show
--run`, `calibrate`, `export`) agree on, what progress a folder holds, and whether a launch into it resumes,
starts again or is refused. Torch-free: the launcher reads it without importing torch or DCP.

    RUN/config.json        the run configuration (run_config.py), written by the launcher before any worker starts
    RUN/plan.json          copies of what the workers ran (rank 0): plan, cluster, resolved runtime paths
    RUN/cluster.json
    RUN/runtime.json
    RUN/metrics.jsonl      one JSON object per optimizer step, appended, never rewritten (runtime/training/metrics.py)
    RUN/timeline.jsonl     per-op times of the last step
    RUN/events.jsonl       elastic re-plans (launch/elastic.py), RUN/elastic/ their plan and cluster files
    RUN/workers.json       the running workers (pid, plan rank, device)
    RUN/checkpoints/       the checkpoint folder unless --checkpoint-dir names another one

    CK/step-000010/        one complete checkpoint: DCP files and manifest.json (runtime/checkpoint/dcp.py)
    CK/step-000010.tmp/    a save in progress (ignored by loads, removed by the next save)
    CK/latest              the name of the newest complete checkpoint, replaced atomically; it never moves back

A launch into folders that hold progress (metric rows or a checkpoint) continues it or refuses, never silently
starts again (`decide_start`): with the same plan and settings it resumes from the newest checkpoint; `--resume`
resumes under any plan; `--overwrite` clears the progress first (`clear_progress`); anything else is one line
naming both options.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError

CONFIG = "config.json"
PLAN_COPY = "plan.json"
CLUSTER_COPY = "cluster.json"
RUNTIME_RECORD = "runtime.json"
METRICS = "metrics.jsonl"
TIMELINE = "timeline.jsonl"
EVENTS = "events.jsonl"
WORKERS = "workers.json"
ELASTIC = "elastic"
CHECKPOINTS = "checkpoints"
# What a run writes into its folder, removed by --overwrite (config.json is rewritten by the launch itself).
RUN_OUTPUTS = (PLAN_COPY, CLUSTER_COPY, RUNTIME_RECORD, METRICS, TIMELINE, EVENTS, WORKERS)

MANIFEST = "manifest.json"
LATEST = "latest"
CHECKPOINT_SCHEMA = "flashflex.checkpoint/1"
STEP_DIR = re.compile(r"^step-(\d{6,})$")
# A checkpoint folder's entries a save leaves (complete, in progress, being replaced), removed by --overwrite.
_CHECKPOINT_ENTRY = re.compile(r"^step-\d{6,}(\.tmp|\.replaced)?$")


def default_checkpoint_dir(out: str | os.PathLike[str]) -> str:
    """The checkpoint folder of run folder `out` when --checkpoint-dir names none: RUN/checkpoints."""
    return os.path.join(os.fspath(out), CHECKPOINTS)


def is_run_folder(path: str | os.PathLike[str]) -> bool:
    """True for a folder `flashflex launch` wrote (it holds config.json or metrics.jsonl)."""
    folder = Path(path)
    return (folder / CONFIG).is_file() or (folder / METRICS).is_file()


def recorded_checkpoint_dir(run: str | os.PathLike[str]) -> str | None:
    """The checkpoint folder run folder `run`'s config.json names, as the launch gave it (None: no file, no
    checkpoints, or an unreadable file)."""
    try:
        named = json.loads((Path(run) / CONFIG).read_text(encoding="utf-8")).get("checkpoint_dir")
    except (OSError, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) and named else None


def run_checkpoint_dir(run: str | os.PathLike[str]) -> Path | None:
    """The checkpoint folder of run folder `run`: the one its config.json names (a relative path as the launch's
    working directory saw it, else inside the run folder), else RUN/checkpoints; None when the run saved none."""
    folder = Path(run)
    named = recorded_checkpoint_dir(folder)
    candidates = [Path(named)] if named else []
    if named and not os.path.isabs(named):
        candidates.append(folder / Path(named).name)
    candidates.append(folder / CHECKPOINTS)
    return next((c for c in candidates if c.is_dir()), None)


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The folder of the checkpoint taken after `step` optimizer steps."""
    return Path(root) / f"step-{step:06d}"


def _step_of(path: Path) -> int:
    found = STEP_DIR.match(path.name)
    return int(found.group(1)) if found else -1


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under `root`: the one `latest` names, else the highest complete step."""
    folder = Path(root)
    pointer = folder / LATEST
    try:
        named = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else ""
    except OSError:
        named = ""
    if named and STEP_DIR.match(named) and (folder / named / MANIFEST).is_file():
        return folder / named
    complete = sorted((p for p in folder.glob("step-*") if STEP_DIR.match(p.name) and (p / MANIFEST).is_file()),
                      key=_step_of)
    return complete[-1] if complete else None


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of one checkpoint folder (InputError naming the file when it is unreadable or foreign)."""
    target = Path(path) / MANIFEST
    try:
        data = json.loads(target.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"{target}: unreadable checkpoint manifest: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"{target}: a checkpoint manifest must be a JSON object")
    if data.get("schema") != CHECKPOINT_SCHEMA:
        raise InputError(f"{target}: unknown checkpoint schema {data.get('schema')!r}")
    return data


def metric_rows(rows_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The step rows of a metrics.jsonl in file order, read leniently (an absent file is no rows; a line that is
    no JSON object with an integer "step", such as half a line of a killed writer, is skipped)."""
    try:
        lines = Path(rows_path).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    rows: list[dict[str, Any]] = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
    return rows


def metric_steps(out: str | os.PathLike[str]) -> list[int]:
    """The step numbers of RUN/metrics.jsonl's rows in file order."""
    return [row["step"] for row in metric_rows(Path(out) / METRICS)]


def launch_index(rows_path: str | os.PathLike[str]) -> int:
    """The number of this launch into a run folder: one more than the highest `launch` of the rows already in
    `rows_path` (0 for an empty or absent file; rows written before the field existed count as launch 0)."""
    launches = [row.get("launch", 0) for row in metric_rows(rows_path)]
    return 1 + max((value if isinstance(value, int) else 0 for value in launches), default=-1)


def latest_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last written of each (a step redone after a resume replaces the earlier row),
    in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_step[int(row["step"])] = row
    return [by_step[step] for step in sorted(by_step)]


def run_identity(*, plan_text: str, model: Mapping[str, Any], train: Mapping[str, Any], data: str, seed: int,
                 schedule_steps: int, lr: float, init_from: str | None) -> dict[str, Any]:
    """What a checkpoint's manifest records of the run that wrote it and an automatic resume must find equal:
    the plan (sha256 of its file text), model, training configuration, data, seed, learning-rate schedule and
    initial weights. `init_from` is recorded as an absolute path."""
    import hashlib

    return {"model": dict(model), "train": dict(train),
            "plan_sha256": hashlib.sha256(plan_text.encode()).hexdigest(), "data": data, "seed": seed,
            "steps": schedule_steps, "lr": lr,
            **({"init_from": os.path.abspath(init_from)} if init_from else {})}


@dataclass(frozen=True)
class Progress:
    """What a run folder and its checkpoint folder hold: metric rows (count, and the highest step) and the
    newest complete checkpoint (its folder, step and manifest; None, 0, None when there is none)."""

    out: str
    checkpoint_dir: str | None
    metric_rows: int
    last_metric_step: int | None
    checkpoint: Path | None
    checkpoint_step: int
    manifest: dict[str, Any] | None

    @property
    def any(self) -> bool:
        """True when there is something a fresh start would lose or contradict."""
        return self.metric_rows > 0 or self.checkpoint is not None

    def text(self) -> str:
        """"metrics to step 10 and a checkpoint at step 10 in CK" (the parts present)."""
        parts = []
        if self.metric_rows:
            parts.append(f"metrics to step {self.last_metric_step}")
        if self.checkpoint is not None:
            parts.append(f"a checkpoint at step {self.checkpoint_step} in {self.checkpoint_dir}")
        return " and ".join(parts) or "nothing"


def folder_progress(out: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str] | None) -> Progress:
    """The progress in run folder `out` and checkpoint folder `checkpoint_dir` (None: no checkpoints)."""
    steps = metric_steps(out)
    found = latest_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    manifest = read_manifest(found) if found is not None else None
    step = manifest.get("step") if manifest is not None else 0
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InputError(f"{found}/{MANIFEST}: field 'step' is not a step count: {step!r}")
    return Progress(os.fspath(out), None if checkpoint_dir is None else os.fspath(checkpoint_dir), len(steps),
                    max(steps) if steps else None, found, step, manifest)


# The manifest fields an automatic resume compares, and how a difference is named.
_IDENTITY_NAMES = {"plan_sha256": "another plan", "model": "another model", "train": "another batch, sequence "
                   "length or precision", "data": "other data", "seed": "another seed",
                   "steps": "another learning-rate schedule length", "lr": "another learning rate",
                   "init_from": "other initial weights"}


def identity_differences(manifest: Mapping[str, Any], identity: Mapping[str, Any]) -> list[str]:
    """How the run that wrote `manifest` differs from a launch of `identity` (run_identity), in words."""
    out = []
    for key, words in _IDENTITY_NAMES.items():
        if manifest.get(key) != identity.get(key):
            if key == "steps":
                words += f" ({manifest.get(key)} steps, this launch {identity.get(key)})"
            elif key == "data":
                words += f" ({manifest.get(key)}, this launch {identity.get(key)})"
            out.append(words)
    return out


@dataclass(frozen=True)
class StartDecision:
    """How a launch begins: `resume` from `progress.checkpoint` (else from step 0), `nothing_left` when the
    checkpoint already reached --steps, and the line saying so (empty for a fresh start in empty folders)."""

    resume: bool
    nothing_left: bool
    line: str


def decide_start(progress: Progress, *, resume: bool, overwrite: bool, steps: int,
                 identity: Mapping[str, Any]) -> StartDecision:
    """Continue, start again or refuse (InputError, one line naming --resume and --overwrite).

    --overwrite: start again (the caller clears the folders first). --resume: continue from the newest checkpoint
    whatever plan and settings wrote it (from step 0 when there is none). Neither: empty folders start; a
    checkpoint written by this plan and settings (`identity`, run_identity) below --steps is continued; any other
    progress is refused, since starting again would lose it and continuing might not be what was meant."""
    where = progress.out
    if overwrite:
        line = f"--overwrite: starting again in {where} (it held {progress.text()})" if progress.any else ""
        return StartDecision(False, False, line)
    found, step = progress.checkpoint, progress.checkpoint_step
    if resume:
        if found is None:
            note = f" ({progress.metric_rows} metric rows kept, later rows appended)" if progress.metric_rows else ""
            return StartDecision(False, False, f"--resume: no checkpoint in {progress.checkpoint_dir} yet, "
                                 f"starting from step 0{note}")
        if step >= steps:
            return StartDecision(True, True, f"{found} is at step {step}, --steps is {steps}: nothing to train")
        return StartDecision(True, False, f"resuming from {found} at step {step}")
    if not progress.any:
        return StartDecision(False, False, "")
    options = "--resume continues from the checkpoint, --overwrite starts again"
    if found is None:
        raise InputError(f"{where} holds {progress.text()} and no checkpoint to continue from: --overwrite starts "
                         "again (or --resume starts from step 0 and appends to the metrics)")
    if step > steps:
        raise InputError(f"{where} holds {progress.text()}, beyond --steps {steps}: raise --steps and pass --resume "
                         "to continue, or --overwrite to start again")
    differences = identity_differences(progress.manifest or {}, identity)
    if differences:
        raise InputError(f"{where} holds {progress.text()} made with {', '.join(differences)}: {options}")
    if step == steps:
        return StartDecision(True, True, f"{where} is complete: {found} is at step {step} of --steps {steps}, "
                             "nothing to train (--overwrite starts again)")
    return StartDecision(True, False, f"{where} holds {progress.text()} of this plan and settings: resuming "
                         "(--overwrite starts again)")


def clear_progress(out: str | os.PathLike[str], checkpoint_dir: str | os.PathLike[str] | None) -> None:
    """Remove what earlier runs wrote into the run folder (RUN_OUTPUTS, RUN/elastic/) and the checkpoint folder
    (step-N folders, saves in progress, `latest`); other files, config.json and the lock files stay."""
    run = Path(out)
    for name in RUN_OUTPUTS:
        (run / name).unlink(missing_ok=True)
    shutil.rmtree(run / ELASTIC, ignore_errors=True)
    if checkpoint_dir is None or not Path(checkpoint_dir).is_dir():
        return
    root = Path(checkpoint_dir)
    (root / LATEST).unlink(missing_ok=True)  # first: a pointer never names a folder already gone
    for entry in root.iterdir():
        if _CHECKPOINT_ENTRY.match(entry.name):
            shutil.rmtree(entry, ignore_errors=True)

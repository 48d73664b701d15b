"""A launch into folders that hold progress continues it or refuses, never silently starts again
(semantics/run_folder.py): the decision for every kind of progress, what --overwrite clears, the metrics rows'
launch index and dedup, and a checkpoint folder's `latest` that never moves back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flashflex_cli.errors import InputError, RuntimeFailure
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.parallel.shards import ShardSpec
from flashflex_cli.semantics.run_folder import (
    CHECKPOINT_SCHEMA,
    clear_progress,
    decide_start,
    folder_progress,
    identity_differences,
    latest_rows,
    launch_index,
    run_checkpoint_dir,
    run_identity,
)

IDENTITY = run_identity(plan_text='{"plan": 1}', model={"name": "m"}, train={"global_batch": 4}, data="synthetic",
                        seed=0, schedule_steps=10, lr=1e-3, init_from=None)


def _checkpoint(root: Path, step: int, identity: dict[str, Any] = IDENTITY) -> Path:
    """A complete checkpoint folder as runtime/checkpoint.save leaves it (manifest only: no tensors needed)."""
    folder = root / f"step-{step:06d}"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"schema": CHECKPOINT_SCHEMA, "step": step, **identity,
                                                      "tensors": {}}))
    (root / "latest").write_text(folder.name)
    return folder


def _metrics(run: Path, steps: list[int], launch: int = 0) -> None:
    run.mkdir(parents=True, exist_ok=True)
    with open(run / "metrics.jsonl", "a") as handle:
        for step in steps:
            handle.write(json.dumps({"step": step, "launch": launch, "loss": 1.0}) + "\n")


def _decide(run: Path, ck: Path | None, steps: int = 10, resume: bool = False, overwrite: bool = False,
            identity: dict[str, Any] = IDENTITY):  # type: ignore[no-untyped-def]
    return decide_start(folder_progress(run, ck), resume=resume, overwrite=overwrite, steps=steps, identity=identity)


def test_empty_folders_start_from_step_zero_without_a_word(tmp_path: Path) -> None:
    decision = _decide(tmp_path / "run", tmp_path / "run" / "checkpoints")
    assert (decision.resume, decision.nothing_left, decision.line) == (False, False, "")


def test_the_same_plan_and_settings_continue_from_their_checkpoint(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _metrics(run, [1, 2, 3, 4, 5])
    _checkpoint(ck, 4)
    decision = _decide(run, ck)
    assert decision.resume and not decision.nothing_left and "resuming" in decision.line


def test_a_complete_run_has_nothing_left_to_train(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _metrics(run, list(range(1, 11)))
    _checkpoint(ck, 10)
    decision = _decide(run, ck)
    assert decision.resume and decision.nothing_left and "nothing to train" in decision.line


@pytest.mark.parametrize(("change", "words"), [
    ({"steps": 3}, "beyond --steps 3"),  # fewer steps than done: the issue's `--steps 3` after 10
    ({"identity": dict(IDENTITY, plan_sha256="0" * 64)}, "another plan"),
    ({"identity": dict(IDENTITY, data="other.bin")}, "other data"),
    ({"identity": dict(IDENTITY, seed=1)}, "another seed"),
    ({"identity": dict(IDENTITY, steps=20)}, "another learning-rate schedule length (10 steps, this launch 20)"),
    ({"identity": dict(IDENTITY, lr=3e-4)}, "another learning rate"),
])
def test_other_plans_or_settings_are_refused_naming_resume_and_overwrite(tmp_path: Path, change: dict[str, Any],
                                                                         words: str) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _metrics(run, list(range(1, 11)))
    _checkpoint(ck, 10)
    with pytest.raises(InputError) as caught:
        _decide(run, ck, **change)
    text = str(caught.value)
    assert words in text and "--resume" in text and "--overwrite" in text and "\n" not in text


def test_metrics_without_a_checkpoint_are_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _metrics(run, [1, 2, 3])
    with pytest.raises(InputError, match="no checkpoint to continue from: --overwrite"):
        _decide(run, run / "checkpoints")
    assert _decide(run, None, resume=True).line.startswith("--resume: no checkpoint")  # from 0, appending


def test_a_checkpoint_folder_shared_with_another_run_counts_as_progress(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "shared", 5, dict(IDENTITY, plan_sha256="1" * 64))
    with pytest.raises(InputError, match="another plan"):
        _decide(tmp_path / "new-run", tmp_path / "shared")


def test_resume_continues_under_any_plan_and_overwrite_starts_again(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _metrics(run, [1, 2, 3, 4])
    _checkpoint(ck, 4, dict(IDENTITY, plan_sha256="2" * 64))
    assert _decide(run, ck, resume=True).resume
    overwrite = _decide(run, ck, overwrite=True)
    assert not overwrite.resume and "--overwrite: starting again" in overwrite.line


def test_overwrite_clears_what_runs_wrote_and_keeps_everything_else(tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    _metrics(run, [1, 2])
    for name in ("plan.json", "cluster.json", "runtime.json", "timeline.jsonl", "events.jsonl", "workers.json",
                 "config.json", "notes.txt", ".lock"):
        (run / name).write_text("x")
    (run / "elastic").mkdir()
    (run / "elastic" / "plan-1.json").write_text("x")
    _checkpoint(ck, 1)
    _checkpoint(ck, 2)
    (ck / "step-000003.tmp").mkdir()
    (ck / ".lock").write_text("x")
    (ck / "README").write_text("mine")
    clear_progress(run, ck)
    assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoints", "config.json", "notes.txt"]
    assert sorted(p.name for p in ck.iterdir()) == [".lock", "README"]
    assert not folder_progress(run, ck).any


def test_rows_keep_their_launch_and_readers_take_the_last_row_of_a_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert launch_index(run / "metrics.jsonl") == 0
    _metrics(run, [1, 2, 3, 4, 5])  # a crash after step 5, the checkpoint at 4
    assert launch_index(run / "metrics.jsonl") == 1
    _metrics(run, [5, 6], launch=1)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kept = latest_rows(rows)
    assert [(r["step"], r["launch"]) for r in kept] == [(1, 0), (2, 0), (3, 0), (4, 0), (5, 1), (6, 1)]


def test_a_run_folder_finds_its_checkpoints_from_another_working_directory(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "runs" / "r1"
    _checkpoint(run / "checkpoints", 3)
    (run / "config.json").write_text(json.dumps({"checkpoint_dir": "runs/r1/checkpoints"}))
    monkeypatch.chdir(tmp_path)
    assert run_checkpoint_dir(Path("runs/r1")) == Path("runs/r1/checkpoints")
    monkeypatch.chdir(run)  # the relative path in config.json means nothing here: the folder's own
    assert run_checkpoint_dir(Path(".")) == Path("checkpoints")


def test_identity_differences_name_each_setting() -> None:
    assert identity_differences(IDENTITY, IDENTITY) == []
    assert identity_differences({}, IDENTITY)  # a manifest written before these fields: not the same run


def test_latest_never_moves_back(tmp_path: Path, world_of_one: None) -> None:
    tensors = {"w": torch.ones(2)}
    shards = {"w": ShardSpec("w", (2,), None, 0, 1, True)}
    ckpt.save(tmp_path, 5, tensors, shards, {})
    with pytest.raises(RuntimeFailure, match="never moves back"):
        ckpt.save(tmp_path, 3, tensors, shards, {})
    assert (tmp_path / "latest").read_text().strip() == "step-000005" and not (tmp_path / "step-000003").exists()
    ckpt.save(tmp_path, 5, tensors, shards, {})  # the same step again replaces it (a re-run of the last save)
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000005"


def test_a_launch_finds_the_checkpoints_an_earlier_launch_of_the_run_folder_put_elsewhere(tmp_path: Path) -> None:
    from flashflex_cli.launch.options import checkpoint_folder

    run = tmp_path / "run"
    assert checkpoint_folder(run, None, None, False, False, False) == str(run / "checkpoints")
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"checkpoint_dir": str(tmp_path / "elsewhere")}))
    assert checkpoint_folder(run, None, None, False, True, False) == str(tmp_path / "elsewhere")
    assert checkpoint_folder(run, tmp_path / "mine", None, False, False, False) == str(tmp_path / "mine")
    assert checkpoint_folder(run, None, None, True, False, False) is None
    for given in ({"checkpoint_dir": tmp_path}, {"checkpoint_every": 5}, {"resume": True}):
        args = {"checkpoint_dir": None, "checkpoint_every": None, "resume": False, **given}
        with pytest.raises(InputError, match="--no-checkpoint contradicts"):
            checkpoint_folder(run, args["checkpoint_dir"], args["checkpoint_every"], True, args["resume"], False)
    with pytest.raises(InputError, match="contradict each other"):
        checkpoint_folder(run, None, None, False, True, True)

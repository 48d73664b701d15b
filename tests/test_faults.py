"""Faults and concurrent use end cleanly and truthfully (docs/reliability.md).

Real local launches of llama-tiny on two emulated CPU ranks (plan-3rank.json's first pipeline: two stages),
signalled once metrics.jsonl shows a step, as a scheduler, a user or a failing machine would. Time bounds are
hang guards only.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp

from flashflex_cli.data.token_file import write_token_file
from flashflex_cli.errors import InputError
from flashflex_cli.launch.failures import checkpoint_note, checkpoint_stamp, describe_failure, root_cause
from flashflex_cli.launch.local import RankExit
from flashflex_cli.launch.lock import run_lock
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.runtime import checkpoint as ckpt
from flashflex_cli.runtime.data import TokenFileSource
from flashflex_cli.semantics.run_folder import CHECKPOINT_SCHEMA
from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = str(GOLDEN / "cluster-2node.json")
TIMEOUT = 10  # --timeout of every job here
HANG_GUARD_S = 4 * TIMEOUT + 60  # generous: a job that hangs fails here instead of blocking the suite
LONG = "100000"  # --steps of a job that runs until it is signalled


@pytest.fixture(scope="module")
def plan2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks: plan-3rank.json without its second pipeline (its micro-batches moved to the first)."""
    plan = json.loads((GOLDEN / "plan-3rank.json").read_text())
    plan["pipelines"] = plan["pipelines"][:1]
    plan["pipelines"][0]["num_micro_batches"] = 8
    plan["unused_devices"], plan["predicted"] = [], None  # node1/0 idles; the prediction was for three ranks
    path = tmp_path_factory.mktemp("plan") / "plan-2rank.json"
    path.write_text(json.dumps(plan))
    return path


class Job:
    """A `flashflex launch` in its own session (its pid is the process group of it and its workers), with
    stderr in a file."""

    def __init__(self, tmp: Path, plan: Path, out: Path, *extra: str,
                 preexec: Callable[[], None] | None = None) -> None:
        self.err_path = tmp / f"stderr-{time.monotonic_ns()}.txt"
        self.out = out
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [FLASHFLEX, "launch", str(plan), "--cluster", CLUSTER, "--out", str(out), "--timeout", str(TIMEOUT),
                 *extra], stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, preexec_fn=preexec)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def last_line(self) -> str:
        return self.stderr.strip().splitlines()[-1]

    def wait_for_step(self, steps: int = 1) -> None:
        """Until metrics.jsonl holds `steps` rows (the workers are training)."""
        metrics = self.out / "metrics.jsonl"
        deadline = time.monotonic() + HANG_GUARD_S
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
            assert self.proc.poll() is None, f"the job ended early:\n{self.stderr}"
            assert time.monotonic() < deadline, "no training step in time"
            time.sleep(0.05)

    def wait(self) -> int:
        return self.proc.wait(timeout=HANG_GUARD_S)

    def workers(self) -> dict[int, int]:
        """{LOCAL_RANK: pid} of the launcher's children."""
        found = {}
        for pid in _pids():
            if _stat(pid)[1] == self.proc.pid:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                rank = next(int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"LOCAL_RANK="))
                found[rank] = pid
        return found

    def kill(self) -> None:
        """Clean up whatever is left of the job."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _stat(pid: int) -> tuple[str, int]:
    """(state, parent pid) of a process; ("X", 0) when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X", 0
    fields = text.rpartition(")")[2].split()
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    return _stat(pid)[0] not in ("X", "Z")  # a zombie no longer runs


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


def test_workers_die_with_their_launcher(plan2: Path, tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path, plan2, tmp_path / "run", "--steps", LONG)
    jobs.append(job)
    job.wait_for_step()
    workers = job.workers()
    assert sorted(workers) == [0, 1]
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers.values() if _alive(pid)], "workers outlived their launcher"
    # the dead job's lock frees once the last process that inherited it is gone (a worker's own helper
    # processes end after it, asynchronously): poll, with the hang guard as the bound
    while True:
        try:
            with run_lock(tmp_path / "run", None):
                break
        except InputError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_frozen_rank_ends_the_job_within_the_timeout(plan2: Path, tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path, plan2, tmp_path / "run", "--steps", LONG)
    jobs.append(job)
    job.wait_for_step()
    frozen = job.workers()[1]
    os.kill(frozen, signal.SIGSTOP)
    assert job.wait() == 1
    last = job.last_line()
    assert last.startswith("error: rank 1 (node node0, device node0/1) failed: no heartbeat for "), last
    assert f"(--timeout {TIMEOUT})" in last and last.endswith("the job was stopped"), last
    _no_traceback(job.stderr)
    assert not _alive(frozen)


def test_sigterm_to_every_process_checkpoints_and_the_run_folder_is_locked(plan2: Path, tmp_path: Path,
                                                                            jobs: list[Job]) -> None:
    run, ck = tmp_path / "run", tmp_path / "ck"
    job = Job(tmp_path, plan2, run, "--steps", LONG, "--schedule-steps", "20", "--checkpoint-dir", str(ck))
    jobs.append(job)
    job.wait_for_step()
    holder = f"pid {job.proc.pid} on host {socket.gethostname()}"
    second = subprocess.run([FLASHFLEX, "launch", str(plan2), "--cluster", CLUSTER, "--out", str(run), "--steps",
                             "3"], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert second.returncode == 2, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1 and holder in second.stderr, second.stderr
    assert "--out" in second.stderr and "in use by a running launch" in second.stderr
    with pytest.raises(InputError, match=re.escape(f"--checkpoint-dir {ck} is in use by a running launch ({holder}")):
        with run_lock(tmp_path / "other-run", ck):  # another run folder, the same checkpoint folder
            pass
    os.killpg(job.proc.pid, signal.SIGTERM)  # scancel, systemd: every process at once
    assert job.wait() == 128 + signal.SIGTERM
    _no_traceback(job.stderr)
    saved = ckpt.latest_checkpoint(ck)
    assert saved is not None
    step = ckpt.read_manifest(saved)["step"]
    assert job.last_line() == (f"stopped by SIGTERM: checkpoint written at step {step} ({saved}); the same command "
                               "continues from it (--resume under another plan or settings)")
    assert len((run / "metrics.jsonl").read_text().splitlines()) == step
    resumed = subprocess.run([FLASHFLEX, "launch", str(plan2), "--cluster", CLUSTER, "--out", str(run), "--steps",
                              str(step + 1), "--schedule-steps", "20", "--checkpoint-dir", str(ck), "--resume"],
                             capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert resumed.returncode == 0, resumed.stderr  # the ended job's lock does not block its resume
    assert f"resumed from {saved} at step {step}" in resumed.stderr


def test_ctrl_c_prints_one_line_and_no_traceback(plan2: Path, tmp_path: Path, jobs: list[Job]) -> None:
    job = Job(tmp_path, plan2, tmp_path / "run", "--steps", LONG, "--no-checkpoint")
    jobs.append(job)
    job.wait_for_step()
    os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal sends the foreground process group
    assert job.wait() == 128 + signal.SIGINT
    _no_traceback(job.stderr)
    assert job.last_line() == "interrupted: no checkpoint was written (--no-checkpoint)"
    assert not [line for line in job.stderr.splitlines() if line.startswith(("error", "flashflex worker"))]


def test_token_file_truncated_while_training_is_named(plan2: Path, tmp_path: Path, jobs: list[Job]) -> None:
    tokens = tmp_path / "tokens.bin"
    write_token_file(tokens, np.arange(50_000) % 256, vocab_size=256)
    job = Job(tmp_path, plan2, tmp_path / "run", "--steps", LONG, "--data", str(tokens))
    jobs.append(job)
    job.wait_for_step()
    os.truncate(tokens, 64)  # the header only
    assert job.wait() == 1
    last = job.last_line()
    assert f"token file {tokens} changed while training (truncated?)" in last and last.startswith("error: rank"), last
    assert "SIGBUS" not in job.stderr
    _no_traceback(job.stderr)


def _limit_file_size() -> None:
    """In the launcher and its workers: writing past 256 KiB fails with EFBIG, as on a full disk (Python
    ignores SIGXFSZ); metrics.jsonl and the plan copies stay far below, a checkpoint shard does not."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


def test_checkpoint_write_error_is_one_line_and_keeps_the_previous(plan2: Path, tmp_path: Path,
                                                                   jobs: list[Job]) -> None:
    run, ck = tmp_path / "run", tmp_path / "ck"
    first = Job(tmp_path, plan2, run, "--steps", "1", "--checkpoint-dir", str(ck))
    jobs.append(first)
    assert first.wait() == 0, first.stderr
    full = Job(tmp_path, plan2, run, "--steps", "3", "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
               "--resume", preexec=_limit_file_size)
    jobs.append(full)
    assert full.wait() == 1
    last = full.last_line()
    assert last.startswith("error: rank") and f"cannot write a checkpoint in {ck}: File too large" in last, last
    _no_traceback(full.stderr)
    assert len(full.stderr.splitlines()) < 20, full.stderr
    assert ckpt.latest_checkpoint(ck) == ck / "step-000001"  # the previous checkpoint and pointer are intact
    assert ckpt.read_manifest(ck / "step-000001")["step"] == 1


# ---- the pieces, in process -------------------------------------------------------------------------------


def test_run_lock_names_the_holder_and_is_freed_on_release(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with run_lock(run, run):  # the same folder twice is locked once
        with pytest.raises(InputError, match=f"pid {os.getpid()} on host {socket.gethostname()}"):
            with run_lock(run, None):
                pass
    assert (run / ".lock").read_text() == ""  # released: no holder left behind (a killed one's blocks nothing)
    with run_lock(run, tmp_path / "ck"):
        pass


def test_checkpoint_note_tells_only_what_was_written(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    assert checkpoint_note(None, None) == "no checkpoint was written (--no-checkpoint)"
    assert checkpoint_note(str(ck), None) == "no checkpoint was written (interrupted before a step boundary)"
    folder = ck / "step-000004"
    folder.mkdir(parents=True)
    (folder / ckpt.MANIFEST).write_text(json.dumps({"schema": CHECKPOINT_SCHEMA, "step": 4}))
    (ck / ckpt.LATEST).write_text("step-000004\n")
    before = checkpoint_stamp(str(ck))
    assert checkpoint_note(str(ck), before).startswith("no checkpoint was written")  # it was there before
    assert checkpoint_note(str(ck), None) == (f"checkpoint written at step 4 ({folder}); the same command continues "
                                              "from it (--resume under another plan or settings)")


def test_root_cause_is_the_frozen_rank_not_those_the_launcher_killed() -> None:
    plan = load_plan(GOLDEN / "plan-3rank.json")
    failures = {0: RankExit(0, 3, 5.0), 1: RankExit(1, -9, 6.0, reason="no heartbeat for 11 s", silent=True),
                2: RankExit(2, -9, 1.0, stopped=True)}
    assert root_cause(failures)[0] == 1
    assert str(describe_failure(plan, None, failures)).startswith(
        "rank 1 (node node0, device node0/1) failed: no heartbeat for 11 s; 2 other rank(s) stopped after it")
    assert root_cause({0: RankExit(0, 3, 5.0), 2: RankExit(2, -9, 1.0, stopped=True)})[0] == 2
    assert root_cause({0: RankExit(0, 1, 5.0), 2: RankExit(2, -9, 1.0, stopped=True)})[0] == 0


def test_save_error_is_one_line_naming_the_folder(tmp_path: Path) -> None:
    full = OSError(28, "No space left on device", "/ck/step-000002.tmp/__0_0.distcp")
    wrapped = dcp.api.CheckpointException("save", {0: (RuntimeError("write failed"), None), 1: (full, None)})
    error = ckpt.save_error("/ck", wrapped)
    assert isinstance(error, ckpt.CheckpointWriteError)
    assert str(error) == "cannot write a checkpoint in /ck: No space left on device (/ck/step-000002.tmp/__0_0.distcp)"
    # no OSError inside (torch's zip writer reports a short write as "unexpected pos"): a probe write finds it
    short = dcp.api.CheckpointException("save", {0: (RuntimeError("unexpected pos 704 vs 598"), None)})
    missing = ckpt.save_error(tmp_path / "gone", short)
    assert isinstance(missing, ckpt.CheckpointWriteError) and "No such file or directory" in str(missing)
    other = ckpt.save_error(tmp_path, dcp.api.CheckpointException("save", {1: (RuntimeError("Connection closed"), None)}))
    assert isinstance(other, RuntimeError) and "\n" not in str(other) and "Connection closed" in str(other)
    assert ckpt.save_error(tmp_path, ValueError("a bug")) is None
    assert list(tmp_path.iterdir()) == []  # the probe is removed


def test_token_file_that_shrinks_is_an_input_error_not_sigbus(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    write_token_file(path, np.arange(4096) % 256, vocab_size=256)
    source = TokenFileSource(path, global_batch=4, seq_len=16)
    first = source.global_batch(0)
    assert first.shape == (4, 17)
    os.truncate(path, 64)  # the header only
    with pytest.raises(InputError, match=re.escape(f"token file {path} changed while training (truncated?)")):
        source.global_batch(1)

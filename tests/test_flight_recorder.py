"""NCCL watchdog aborts (a GPU rank's collective outlived its timeout: SIGABRT, no Python exception) are reported as
a rank that waited for a lost peer, the rank that failed first is named, and the flight recorder's dumps go to
the run folder (semantics/flight_recorder.py, launch/failures.py). Exit codes and records are synthetic: what the
launcher reads is the same on CPU."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flashflex_cli.launch.failures import (
    WATCHDOG_TEXT,
    describe_failure,
    describe_local_failure,
    exit_text,
    root_cause,
)
from flashflex_cli.launch.local import RankExit, worker_env
from flashflex_cli.launch.options import FLIGHT_RECORDER_SHELL
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.semantics import flight_recorder

GOLDEN = Path(__file__).parent / "golden"
PLAN = load_plan(GOLDEN / "plan-4rank.json")  # ranks 0, 1, 3 on node0; rank 2 on node1
RECORDER_NAMES = ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE",
                  "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RECORDER_NAMES:
        monkeypatch.delenv(name, raising=False)


def test_worker_settings_keep_the_users_values(tmp_path: Path) -> None:
    env = flight_recorder.worker_env(tmp_path / "run", {})
    assert env == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                   "TORCH_FR_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": f"{tmp_path}/run/nccl-trace/rank-",
                   "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/run/nccl-trace/rank-"}
    # a value the user set under either name is kept, and the other name is not set beside it
    mine = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr-"}
    assert flight_recorder.worker_env(tmp_path, mine) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert flight_recorder.prefix_in_effect(tmp_path, mine) == "/scratch/fr-"


def test_prepare_creates_the_dump_folder_before_the_process_group(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    prefix = flight_recorder.prepare(tmp_path / "run", env)
    assert prefix == str(tmp_path / "run" / "nccl-trace" / "rank-") and (tmp_path / "run" / "nccl-trace").is_dir()
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    theirs = {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "elsewhere" / "r")}
    assert flight_recorder.prepare(tmp_path / "run2", theirs) == str(tmp_path / "elsewhere" / "r")
    assert (tmp_path / "elsewhere").is_dir() and not (tmp_path / "run2").exists()


def test_local_workers_get_the_recorder_with_dumps_in_the_run_folder(monkeypatch: pytest.MonkeyPatch,
                                                                     clean_env: None) -> None:
    env = worker_env(0, 2, 29500, "/tmp/j", 60.0, "runs/r")
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == os.path.join("runs/r", "nccl-trace", "rank-")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    assert worker_env(0, 2, 29500, "/tmp/j", 60.0, "runs/r")["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


@pytest.mark.parametrize("theirs", [None, "0"])
def test_rendered_settings_expand_in_bash_and_keep_the_users_value(theirs: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in RECORDER_NAMES}
    if theirs is not None:
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = theirs
    out = subprocess.run(["bash", "-c", f"env {FLIGHT_RECORDER_SHELL} env"], env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert f"TORCH_NCCL_DUMP_ON_TIMEOUT={theirs or '1'}" in out and "TORCH_NCCL_TRACE_BUFFER_SIZE=2000" in out


def test_a_watchdog_abort_is_a_rank_that_waited_not_the_cause() -> None:
    prefix = "runs/r/nccl-trace/rank-"
    assert exit_text(-6, nccl=True) == exit_text(134, nccl=True) == WATCHDOG_TEXT
    assert exit_text(-6) == "killed by signal 6 (SIGABRT)"  # gloo: a signal nobody in the job sends
    # rank 0 aborted first, waiting; rank 1 raised an error of its own later
    failures = {0: RankExit(0, -6, 10.0), 1: RankExit(1, 1, 12.0, reason="ValueError: bad batch")}
    assert root_cause(failures, nccl=True)[0] == 1
    assert str(describe_failure(PLAN, None, failures, nccl=True, trace_prefix=prefix)) == (
        "rank 1 (node node0, device node0/1) failed: ValueError: bad batch; 1 rank(s) aborted by the NCCL watchdog "
        f"waiting for a peer (flight recorder dumps: {prefix}N); the job was stopped")
    # on a CPU plan the same exits keep their old reading: the signal is the cause
    assert root_cause({0: RankExit(0, -6, 10.0), 1: RankExit(1, 3, 12.0)})[0] == 0


def test_the_rank_that_never_came_is_named_over_the_aborted_ones() -> None:
    failures = {0: RankExit(0, -6, 10.0), 1: RankExit(1, 134, 10.5), 2: RankExit(2, -9, 13.0, stopped=True),
                3: RankExit(3, 3, 11.0)}
    assert root_cause(failures, nccl=True)[0] == 2
    text = str(describe_failure(PLAN, None, failures, nccl=True))
    assert text.startswith("rank 2 (node node1, device node1/0) failed: still running when the NCCL watchdog "
                           "aborted its peers"), text
    assert "2 rank(s) aborted by the NCCL watchdog waiting for a peer, 1 other rank(s) stopped after it" in text
    # a frozen rank or an out-of-memory still comes first
    frozen = {0: RankExit(0, -6, 10.0), 1: RankExit(1, -9, 14.0, reason="no heartbeat for 70 s", silent=True)}
    assert root_cause(frozen, nccl=True)[0] == 1


def test_when_every_rank_was_aborted_none_is_blamed() -> None:
    failures = {0: RankExit(0, -6, 10.0), 3: RankExit(3, -6, 10.2)}
    text = str(describe_failure(PLAN, None, failures, nccl=True, trace_prefix="R/nccl-trace/rank-"))
    assert text == ("rank 0 (node node0, device node0/0), rank 3 (node node0, device node0/2): aborted by the NCCL "
                    "watchdog waiting for a peer (SIGABRT); none reported an error of its own: which collective "
                    "each waited in tells the peer that never came (flight recorder dumps: R/nccl-trace/rank-N); "
                    "the job was stopped")


@dataclass
class _Device:
    type: str


class _Cluster:
    """The one lookup describe_local_failure makes: every device of this cluster has `kind`."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def device(self, _name: str) -> Any:
        return _Device(self.kind)


def test_local_report_reads_sigabrt_by_the_plans_devices(monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    failures = {0: RankExit(0, -6, 10.0), 1: RankExit(1, 1, 12.0, reason="ValueError: x")}
    gpu = str(describe_local_failure(PLAN, _Cluster("H100-80G-SXM"), failures, "runs/r"))  # type: ignore[arg-type]
    assert gpu.startswith("rank 1 ") and f"dumps: {os.path.join('runs/r', 'nccl-trace', 'rank-')}N" in gpu
    cpu = str(describe_local_failure(PLAN, _Cluster("cpu"), failures, "runs/r"))  # type: ignore[arg-type]
    assert cpu.startswith("rank 0 ") and "killed by signal 6 (SIGABRT)" in cpu

"""`flashflex launch` end to end on CPU ranks (supervised local launch + gloo), failures, and preflight refusals."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from flashflex_cli.cli import main
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.launch.failures import describe_failure, exit_text, root_cause
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.training.worker import plan_rank
from flashflex_cli.semantics.run_folder import CHECKPOINT_SCHEMA, latest_rows
from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = str(GOLDEN / "cluster-2node.json")
STEPS = 6


def _launch(plan: str | Path, out: Path, *extra: str, env: dict[str, str] | None = None,
            cluster: str = CLUSTER) -> subprocess.CompletedProcess:
    return subprocess.run([FLASHFLEX, "launch", str(GOLDEN / plan), "--cluster", cluster, "--out", str(out),
                           "--timeout", "30", *extra], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **(env or {})})


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Metrics of the 4-rank plan (2 pipelines: TP2 + TP1 stages, and one single-stage pipeline)."""
    out = tmp_path_factory.mktemp("ref")
    result = _launch("plan-4rank.json", out, "--steps", str(STEPS))
    assert result.returncode == 0, result.stderr
    assert f"done: steps 1-{STEPS} of {STEPS}" in result.stdout and "step time" in result.stdout
    assert result.stdout.count("metrics.jsonl") == 1 and "checkpoint: " in result.stdout
    return _rows(out)


@pytest.mark.slow
def test_four_cpu_ranks_train_and_write_metrics(reference: list[dict]) -> None:
    assert [row["step"] for row in reference] == list(range(1, STEPS + 1))
    for row in reference:
        for key in ("loss", "tokens_per_s", "mfu", "step_time_s", "lr", "grad_norm", "memory_bytes"):
            assert isinstance(row[key], int | float) and row[key] >= 0, key
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["memory_bytes"] > 50 * 2**20
        stages = {(s["pipeline"], s["stage"]) for s in row["stages"]}
        assert stages == {(0, 0), (0, 1), (1, 0)}  # one entry per stage, from its TP rank 0
        for stage in row["stages"]:
            assert stage["forward_s"] > 0 and stage["backward_s"] > 0 and stage["comm_s"] >= 0
        tp2 = next(s for s in row["stages"] if (s["pipeline"], s["stage"]) == (0, 0))
        assert tp2["tp_comm_s"] > 0  # the TP-2 stage all-reduces; single-device stages do not
        assert all(s["tp_comm_s"] == 0 for s in row["stages"] if s is not tp2)
        # two pipelines hold every layer: every stage reduces gradients, overlapped (dp_s is the exposed part)
        assert all(s["dp_total_s"] > 0 and s["dp_s"] >= 0 for s in row["stages"])
    assert 5.0 < reference[0]["loss"] < 6.0  # about ln(256) = 5.55 for a fresh model


@pytest.mark.slow
def test_one_process_plan_gives_the_same_losses(reference: list[dict], tmp_path: Path) -> None:
    result = _launch("plan-1rank.json", tmp_path, "--steps", str(STEPS))
    assert result.returncode == 0, result.stderr
    for mine, ref in zip(_rows(tmp_path), reference, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5), mine["step"]


@pytest.mark.slow
def test_killed_rank_ends_the_job_and_resume_under_another_plan(reference: list[dict], tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "ck"
    crashed = _launch("plan-3rank.json", run, "--steps", str(STEPS), "--checkpoint-dir", str(ck),
                      "--checkpoint-every", "3", env={"FLASHFLEX_FAULT_INJECT": "rank=1,step=4"})
    assert crashed.returncode == 1, crashed.stderr
    last = crashed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 (node node0, device node0/1) failed: killed by signal 9 (SIGKILL)"), last
    assert "Traceback" not in crashed.stderr  # a hang instead of an exit fails by _launch's timeout
    assert ckpt.latest_checkpoint(ck) == ck / "step-000003"  # the checkpoint before the crash is intact
    # a device was lost: resume on a different plan (4 ranks, other pipelines, TP 2) from the 3-rank checkpoint
    resumed = _launch("plan-4rank.json", run, "--steps", str(STEPS), "--checkpoint-dir", str(ck), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "at step 3" in resumed.stderr
    appended = _rows(run)  # step 4 ran before the crash and again after the resume: appended, never cut
    assert [row["step"] for row in appended] == [1, 2, 3, 4, *range(4, STEPS + 1)]
    rows = latest_rows(appended)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for mine, ref in zip(rows, reference, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5), mine["step"]


def test_failure_report_names_the_root_cause_rank() -> None:
    class F:  # the fields of torch elastic's ProcessFailure that the report reads
        def __init__(self, local_rank: int, exitcode: int, timestamp: int) -> None:
            self.local_rank, self.exitcode, self.timestamp = local_rank, exitcode, timestamp

    plan = load_plan(GOLDEN / "plan-4rank.json")
    failures = {0: F(0, 3, 100), 2: F(2, -9, 105), 3: F(3, 3, 99)}
    assert root_cause(failures)[0] == 2  # the signal, not the peers that lost it
    message = str(describe_failure(plan, None, failures))
    assert message.startswith("rank 2 (node node1, device node1/0) failed: killed by signal 9 (SIGKILL)")
    # on host "node0" local rank 2 is plan rank 3 (node0's devices in plan rank order are ranks 0, 1, 3)
    assert str(describe_failure(plan, "node0", {5: F(2, 1, 0)})).startswith("rank 3 (node node0, device node0/2)")
    assert exit_text(3).endswith("(a peer rank failed)")
    assert [plan_rank(plan, "node0", i) for i in range(3)] == [0, 1, 3] and plan_rank(plan, "node1", 0) == 2
    assert [plan_rank(plan, None, i) for i in range(4)] == [0, 1, 2, 3]


def _gpu_fixture(tmp_path: Path) -> tuple[Path, Path]:
    """A one-node cluster of two A100s and a plan for it (made by hand, as a user might)."""
    cluster = json.loads(Path(CLUSTER).read_text())
    gpu = {"type": "A100-80G-SXM", "memory_bytes": 80 * 2**30, "peak_flops": {"bf16": 312e12},
           "memory_bandwidth": 2.0e12}
    cluster["nodes"] = [{"name": "g0", "devices": [gpu, gpu], "intra_link": {"kind": "nvlink"}}]
    (tmp_path / "gpu.json").write_text(json.dumps(cluster))
    plan = json.loads((GOLDEN / "plan-1rank.json").read_text())
    plan["inputs"]["cluster_sha256"] = load_cluster(tmp_path / "gpu.json").sha256()
    plan["pipelines"][0]["stages"][0]["devices"] = ["g0/1"]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    return tmp_path / "plan.json", tmp_path / "gpu.json"


def test_preflight_refuses_mismatches_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = str(GOLDEN / "plan-4rank.json")

    def launch(*args: str) -> subprocess.CompletedProcess:  # in process: the CLI's own error handling
        capsys.readouterr()
        code = main(["launch", *args, "--out", str(tmp_path / "run")])
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, captured.out, captured.err)

    if not torch.cuda.is_available():
        gpu_plan, gpu_cluster = _gpu_fixture(tmp_path)
        refused = launch(str(gpu_plan), "--cluster", str(gpu_cluster))
        assert refused.returncode == 1 and "has no CUDA device" in refused.stderr
    tokens = tmp_path / "big.bin"
    from flashflex_cli.data.token_file import write_token_file

    write_token_file(tokens, torch.arange(2000).numpy() % 1000, vocab_size=1000)
    bad_data = launch(plan, "--cluster", CLUSTER, "--data", str(tokens))
    assert bad_data.returncode == 2 and "exceeds the model's vocab_size 256" in bad_data.stderr
    no_dir = launch(plan, "--cluster", CLUSTER, "--resume", "--no-checkpoint")
    assert no_dir.returncode == 2 and "--no-checkpoint contradicts --resume" in no_dir.stderr
    ck = tmp_path / "ck" / "step-000002"
    ck.mkdir(parents=True)
    (ck / "manifest.json").write_text(json.dumps({"schema": CHECKPOINT_SCHEMA, "step": 2, "tensors": {},
                                                  "model": {"name": "llama-other"}, "train": {}}))
    other_model = launch(plan, "--cluster", CLUSTER, "--checkpoint-dir", str(tmp_path / "ck"), "--resume")
    assert other_model.returncode == 1 and "resume needs the same model" in other_model.stderr
    for result in (bad_data, no_dir, other_model):
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()  # nothing started, nothing written

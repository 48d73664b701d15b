"""`flashflex launch --share-gpu` (launch/share_gpu.py): the environment each rank gets, the refusals, and the
preflight's check of every rank's prediction together against the one GPU (a fake torch.cuda stands in)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flashflex_cli.errors import CheckFailed
from flashflex_cli.hardware.cluster import Cluster, save_cluster
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.launch.local import worker_env
from flashflex_cli.launch.preflight import check_local_machine, rank_memory_bytes
from flashflex_cli.launch.share_gpu import share_gpu_env
from flashflex_cli.plan.schema import Plan, save_plan
from flashflex_cli.run_config import load_run_config
from tests.conftest import FLASHFLEX

from .test_hier_reduce import on_nodes
from .test_parity import make_plan

GOLDEN = Path(__file__).parent / "golden"
GPU = build_cluster("2x2xA100-80G-SXM:nic=ib")
SHARED_NAMES = ("NCCL_HOSTID", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME")


def gpu_plan(cluster: Cluster = GPU) -> Plan:
    """Two pipelines of llama-tiny on the cluster's first 3 GPUs: TP 2 on node0, one GPU of node1."""
    plan = make_plan("llama-tiny", [(1, 2, [(2, (0, 4))]), (1, 2, [(1, (0, 4))])])
    plan = on_nodes(plan, cluster.device_ids[:3])
    return plan.model_copy(update={"inputs": plan.inputs.model_copy(update={"cluster_sha256": cluster.sha256()})})


def test_every_rank_is_its_own_nccl_host_on_loopback() -> None:
    envs = [share_gpu_env(rank, {}) for rank in range(3)]
    assert len({env["NCCL_HOSTID"] for env in envs}) == 3
    assert all(env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == env["NCCL_IB_DISABLE"] == "1" for env in envs)
    assert all(env["NCCL_SOCKET_IFNAME"] == "lo" for env in envs)
    mine = share_gpu_env(1, {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_HOSTID": "same-for-all"})
    assert "NCCL_SOCKET_IFNAME" not in mine  # the user's interface is kept ...
    assert mine["NCCL_HOSTID"] == envs[1]["NCCL_HOSTID"]  # ... a shared host id never: NCCL would refuse


def test_local_workers_get_it_only_in_share_gpu_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SHARED_NAMES:
        monkeypatch.delenv(name, raising=False)
    shared = [worker_env(rank, 2, 29500, "/tmp/j", 60.0, "runs/r", share_gpu=True) for rank in range(2)]
    assert shared[0]["NCCL_HOSTID"] != shared[1]["NCCL_HOSTID"] and shared[0]["NCCL_SOCKET_IFNAME"] == "lo"
    plain = worker_env(0, 2, 29500, "/tmp/j", 60.0, "runs/r")
    assert not set(SHARED_NAMES) & set(plain)


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, total: float) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=int(total)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Fake GPU")


def test_preflight_checks_all_ranks_together_against_the_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = gpu_plan()
    need = sum(rank_memory_bytes(plan, GPU))
    assert need > max(rank_memory_bytes(plan, GPU))  # more than any one rank: the sum is what is checked
    _fake_gpu(monkeypatch, need * 1.01)
    report = check_local_machine(plan, GPU, share_gpu=True)
    assert any("--share-gpu: 3 ranks share cuda:0 (Fake GPU)" in w for w in report.warnings)
    _fake_gpu(monkeypatch, need * 0.99)
    with pytest.raises(CheckFailed, match=r"^--share-gpu: the plan's 3 ranks need about .* together .*, cuda:0 has"):
        check_local_machine(plan, GPU, share_gpu=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CheckFailed, match="has no CUDA device"):
        check_local_machine(plan, GPU, share_gpu=True)


def _launch(tmp_path: Path, plan: Plan, cluster: Cluster, *extra: str) -> subprocess.CompletedProcess[str]:
    save_plan(tmp_path / "plan.json", plan)
    save_cluster(tmp_path / "cluster.json", cluster)
    return subprocess.run([FLASHFLEX, "launch", str(tmp_path / "plan.json"), "-c", str(tmp_path / "cluster.json"),
                           "--out", str(tmp_path / "run"), "--share-gpu", *extra], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(("case", "extra", "message"), [
    ("cpu-plan", (), "--share-gpu needs a plan of GPUs; node0/0 is an emulated CPU device (3 of the plan's 3 ranks)"),
    ("torchrun", ("--launcher", "torchrun"), "--share-gpu runs every rank on this machine's GPU: it needs "
                                             "--launcher local, got torchrun"),
    ("elastic", ("--elastic", "--checkpoint-dir", "CK"), "--share-gpu is a validation mode and cannot be combined "
                                                         "with --elastic"),
])
def test_refusals_are_one_line_exit_2_and_touch_nothing(tmp_path: Path, case: str, extra: tuple[str, ...],
                                                        message: str) -> None:
    cluster = build_cluster("2x2xcpu") if case == "cpu-plan" else GPU
    extra = tuple(str(tmp_path / "ck") if arg == "CK" else arg for arg in extra)
    result = _launch(tmp_path, gpu_plan(cluster), cluster, *extra)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {message}"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "ck").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the launch would start")
def test_a_gpu_plan_without_a_gpu_is_a_failed_check(tmp_path: Path) -> None:
    result = _launch(tmp_path, gpu_plan(), GPU, "--steps", "1")
    assert result.returncode == 1 and "has no CUDA device" in result.stderr.strip().splitlines()[-1], result.stderr
    assert not (tmp_path / "run").exists()
    dry = _launch(tmp_path, gpu_plan(), GPU, "--launcher", "local", "--dry-run")
    assert dry.returncode == 1  # a dry run checks the machine too


def test_the_run_configuration_records_the_mode(tmp_path: Path) -> None:
    from flashflex_cli.launch.options import launch_config
    from flashflex_cli.run_config import save_run_config

    config = launch_config(plan="p.json", cluster="c.json", out=str(tmp_path / "run"), share_gpu=True)
    save_run_config(config)
    assert load_run_config(tmp_path / "run" / "config.json").share_gpu
    assert json.loads((tmp_path / "run" / "config.json").read_text())["share_gpu"] is True

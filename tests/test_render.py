"""Rendered torchrun commands and SLURM scripts against golden files; templates a user can edit.

Set FLASHFLEX_UPDATE_GOLDEN=1 to rewrite the golden files after an intended change (and review the diff).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from flashflex_cli.errors import InputError
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.launch.layout import node_layouts
from flashflex_cli.launch.options import ALLOC_CONF_SHELL, launch_config
from flashflex_cli.launch.slurm import SlurmSettings, default_template, render_slurm
from flashflex_cli.launch.torchrun import RenderSettings, command_lines, render_torchrun
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.run_config import load_run_config
from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
PLAN = load_plan(GOLDEN / "plan-4rank.json")
CLUSTER = load_cluster(GOLDEN / "cluster-2node.json")
OPTIONS = launch_config(plan="plans/plan-4rank.json", cluster="profiles/cluster-2node.json", out="runs/r1",
                        data="runs/data.bin", steps=30, checkpoint_dir="runs/ckpt", checkpoint_every=10)


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("FLASHFLEX_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with FLASHFLEX_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from its golden file"


def test_golden_plans_belong_to_the_golden_cluster() -> None:
    for name in ("plan-1rank.json", "plan-3rank.json", "plan-4rank.json"):
        assert load_plan(GOLDEN / name).inputs.cluster_sha256 == CLUSTER.sha256(), (
            "the Cluster schema changed: run .venv/bin/python tests/golden/make_golden.py")


def test_layout_groups_devices_by_node_in_plan_rank_order() -> None:
    layouts = node_layouts(PLAN, CLUSTER)
    assert [(x.name, x.ranks, x.devices) for x in layouts] == [
        ("node0", (0, 1, 3), ("node0/0", "node0/1", "node0/2")),
        ("node1", (2,), ("node1/0",)),
    ]
    with pytest.raises(InputError, match="names 1 hosts, the plan uses 2 nodes"):
        node_layouts(PLAN, CLUSTER, ["a"])


def test_torchrun_commands_match_golden_and_parse_as_torchrun() -> None:
    settings = RenderSettings(hosts=("10.200.0.1", "10.200.0.2"), ifnames=("veth0", "veth1"), port=29511,
                              run_id="job7")
    text = render_torchrun(PLAN, CLUSTER, OPTIONS, settings)
    _check_golden("torchrun-4rank.sh", text)
    lines = command_lines(text)
    assert len(lines) == 2
    for i, (line, nproc) in enumerate(zip(lines, (3, 1), strict=True)):
        argv = shlex.split(line)
        # (shlex leaves the defaults' "${...:-...}" unexpanded; bash expands them: test_runtime_switches)
        assert argv[:6] == ["env", "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}",
                            "TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}",
                            "TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}",
                            f"GLOO_SOCKET_IFNAME=veth{i}", f"NCCL_SOCKET_IFNAME==veth{i}"] and argv[6] == "torchrun"
        args = get_args_parser().parse_args(argv[7:])  # torchrun's own parser accepts the line
        assert args.nproc_per_node == str(nproc) and args.nnodes == "2" and args.module
        assert args.rdzv_endpoint == "10.200.0.1:29511" and args.rdzv_conf == f"is_host={1 - i}"
        assert args.local_addr == f"10.200.0.{i + 1}" and args.max_restarts == 0
        assert args.training_script == "flashflex_cli.runtime.training.worker"
        # every setting is in the run configuration the launch saves; the line names it and the plan node
        assert args.training_script_args == ["--config", "runs/r1/config.json", "--plan-node", f"node{i}"]


@pytest.mark.parametrize(("template", "golden"), [(None, "slurm-hetjob-4rank.sbatch"),
                                                  ("slurm", "slurm-4rank.sbatch")])
def test_slurm_scripts_match_golden_and_are_valid_bash(template: str | None, golden: str) -> None:
    assert default_template(PLAN, CLUSTER) == "slurm-hetjob"  # the two nodes run 3 and 1 processes
    text = render_slurm(PLAN, CLUSTER, OPTIONS, RenderSettings(template=template, torchrun=".venv/bin/torchrun"),
                        SlurmSettings(job_name="ffx-test", log="runs/slurm-%j.out"))
    _check_golden(golden, text)
    assert text.count("srun ") == 2 and "--nproc-per-node=3" in text and "--nproc-per-node=1" in text
    assert ("#SBATCH hetjob" in text) == (template is None)
    if shutil.which("bash"):
        check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stderr


def test_user_templates_and_template_errors(tmp_path: Path) -> None:
    custom = tmp_path / "mine.tmpl"
    custom.write_text("echo {{ nnodes }} nodes\n#>>> node\nssh {{ host }} {{ nproc }}\n#<<< node\necho ${HOME}\n")
    text = render_torchrun(PLAN, CLUSTER, OPTIONS, RenderSettings(template=str(custom)))
    assert text == "echo 2 nodes\nssh node0 3\nssh node1 1\necho ${HOME}\n"
    custom.write_text("line one\n{{ nodes_count }}\n")
    with pytest.raises(InputError, match=r"mine.tmpl:2: unknown template field \{\{ nodes_count \}\}"):
        render_torchrun(PLAN, CLUSTER, OPTIONS, RenderSettings(template=str(custom)))
    with pytest.raises(InputError, match="no launcher template 'nope'"):
        render_torchrun(PLAN, CLUSTER, OPTIONS, RenderSettings(template="nope"))


def test_cli_renders_and_refuses_a_mismatched_cluster(tmp_path: Path) -> None:
    plan, cluster = str(GOLDEN / "plan-4rank.json"), str(GOLDEN / "cluster-2node.json")
    script, run = tmp_path / "launch.sh", tmp_path / "run"
    ok = subprocess.run([FLASHFLEX, "launch", plan, "--cluster", cluster, "--launcher", "torchrun", "--script",
                         str(script), "--hosts", "h0,h1", "--out", str(run), "--steps", "7", "--lr", "0.002"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert os.access(script, os.X_OK) and len(command_lines(script.read_text())) == 2
    config = load_run_config(run / "config.json")  # what the rendered lines' workers read
    assert (config.plan, config.cluster, config.steps, config.optimizer.lr) == (plan, cluster, 7, 0.002)
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json"]
    dry = subprocess.run([FLASHFLEX, "launch", plan, "--cluster", cluster, "--dry-run", "--steps", "3", "--out",
                          str(tmp_path / "dry")], capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.startswith(f"env {ALLOC_CONF_SHELL} torchrun --standalone --nnodes=1 --nproc-per-node=4 ")
    assert dry.stdout.rstrip().endswith(f"-m flashflex_cli.runtime.training.worker --config {tmp_path / 'dry' / 'config.json'}")
    dry = subprocess.run([FLASHFLEX, "launch", plan, "--cluster", cluster, "--launcher", "slurm", "--dry-run",
                          "--out", str(tmp_path / "dry")], capture_output=True, text=True)
    assert dry.returncode == 0 and "srun " in dry.stdout, dry.stderr
    assert not (tmp_path / "dry").exists()  # a dry run writes no run configuration
    other = tmp_path / "other.json"
    other.write_text(Path(cluster).read_text().replace('"test-2node"', '"renamed"'))
    bad = subprocess.run([FLASHFLEX, "launch", plan, "--cluster", str(other), "--launcher", "slurm", "--out",
                          str(tmp_path / "bad")], capture_output=True, text=True)
    assert bad.returncode == 1 and "is not the cluster this plan was made for" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stdout == ""
    assert not (tmp_path / "bad").exists()

"""`flashflex launch --gpus 2,3`: the workers see only the listed GPUs, in order (launch/gpu_subset.py); what a
worker will see is what preflight checks; refusals are one line and start nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.errors import InputError
from flashflex_cli.hardware.cluster import save_cluster
from flashflex_cli.hardware.gpu_identity import LocalGpu, cuda_ordinal
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.launch.gpu_subset import gpus_env, listed_gpus
from flashflex_cli.launch.local import worker_env
from flashflex_cli.validate_numbers import gpu_list

GOLDEN = Path(__file__).parent / "golden"


def test_the_list_is_checked() -> None:
    assert gpu_list("2,3") == (2, 3) and gpu_list(" 1 ") == (1,)
    for bad in ("", "1,,2", "-1", "a", "1,1", "2048"):
        with pytest.raises(InputError):
            gpu_list(bad)


def test_workers_see_only_the_listed_gpus_in_order(tmp_path: Path) -> None:
    env = worker_env(0, 2, 29500, str(tmp_path), 60.0, gpus=(3, 1))
    assert env["CUDA_VISIBLE_DEVICES"] == "3,1" and gpus_env(None) == {}
    host = [LocalGpu(i, f"uuid-{i}", None) for i in range(4)]
    seen = listed_gpus(host, (3, 1))
    assert seen == [LocalGpu(0, "uuid-3", None), LocalGpu(1, "uuid-1", None)]
    assert cuda_ordinal("n/1", None, None, 1, seen) == 1  # node/1 -> the second listed GPU, physical 1
    assert cuda_ordinal("n/0", "uuid-1", None, 0, seen) == 1  # a recorded identity wins over the position
    with pytest.raises(InputError, match="no GPU 7"):
        listed_gpus(host, (7,))


def test_a_gpu_plan_launch_with_gpus_renders_the_mask_and_refusals_are_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "gpus.json"
    save_cluster(cluster, build_cluster("1x4xH100-SXM", name="gpus"))
    plan = tmp_path / "plan.json"
    assert main(["plan", str(cluster), "--model", "llama-tiny", "--global-batch", "8", "--seq-len", "32",
                 "--time-budget", "5", "--no-baseline", "--out", str(plan)]) == 0
    used = max(int(d.rpartition("/")[2]) for p in json.loads(plan.read_text())["pipelines"]
               for s in p["stages"] for d in s["devices"])
    capsys.readouterr()
    run = tmp_path / "run"
    too_few = ",".join(str(i) for i in range(used))  # one GPU fewer than the plan's highest device needs
    for extra, words in ((["--gpus", "0,0"], "names a GPU twice"),
                         (["--gpus", too_few or "x"], "needs at least" if used else "GPU indices"),
                         (["--gpus", "0,1,2,3", "--share-gpu"], "contradict"),
                         (["--gpus", "0,1,2,3", "--launcher", "slurm"], "CUDA_VISIBLE_DEVICES")):
        assert main(["launch", str(plan), "--out", str(run), *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, err
    assert not run.exists()
    cpu = main(["launch", str(GOLDEN / "plan-1rank.json"), "--cluster", str(GOLDEN / "cluster-2node.json"),
                "--out", str(run), "--gpus", "0", "--dry-run"])
    assert cpu == 2 and "emulated CPU device" in capsys.readouterr().err

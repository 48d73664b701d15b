"""Regenerate the cluster and plans under tests/golden/ (run after a change to the Cluster or Plan schema):

    .venv/bin/python tests/golden/make_golden.py

Then refresh the rendered golden scripts: FLASHFLEX_UPDATE_GOLDEN=1 .venv/bin/pytest tests/test_render.py
"""

from __future__ import annotations

from pathlib import Path

from flashflex_cli.hardware.cluster import Cluster, save_cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan, save_plan

HERE = Path(__file__).parent


def _device(slowdown: float = 1.0) -> dict:
    return {"type": "cpu", "memory_bytes": 4 * 1024**3, "peak_flops": {"fp32": 1e11}, "memory_bandwidth": 2e10,
            "slowdown": slowdown}


def _stage(devices: list[str], layers: tuple[int, int]) -> dict:
    return {"devices": devices, "tp": len(devices), "layers": list(layers)}


def main() -> None:
    """Write cluster-2node.json (node0: 3 CPU devices, the third 1.5x slower; node1: 1) and three plans."""
    cluster = Cluster.model_validate({
        "schema": "flashflex.cluster/1", "name": "test-2node",
        "nodes": [{"name": "node0", "nic": "eth", "devices": [_device(), _device(), _device(1.5)],
                   "intra_link": {"kind": "shm"}},
                  {"name": "node1", "nic": "eth", "devices": [_device()], "intra_link": {"kind": "shm"}}]})
    save_cluster(HERE / "cluster-2node.json", cluster)
    inputs = {"cluster_sha256": cluster.sha256(), "cluster_name": cluster.name,
              "model": PRESETS["llama-tiny"].model_dump(), "strategy": "manual",
              "train": {"global_batch": 8, "seq_len": 32, "micro_batch_size": 1, "dtype": "fp32"}}
    plans = {
        # 4 ranks: pipeline 0 = TP2 stage on node0 + TP1 stage on node1; pipeline 1 = one device of node0
        "plan-4rank.json": [
            {"micro_batch_size": 1, "num_micro_batches": 4,
             "stages": [_stage(["node0/0", "node0/1"], (0, 2)), _stage(["node1/0"], (2, 4))]},
            {"micro_batch_size": 1, "num_micro_batches": 4, "stages": [_stage(["node0/2"], (0, 4))]}],
        "plan-1rank.json": [
            {"micro_batch_size": 2, "num_micro_batches": 4, "stages": [_stage(["node0/0"], (0, 4))]}],
        # 3 ranks: a two-stage pipeline on node0, and a one-stage pipeline on node1 with a larger micro-batch
        "plan-3rank.json": [
            {"micro_batch_size": 1, "num_micro_batches": 4,
             "stages": [_stage(["node0/0"], (0, 2)), _stage(["node0/1"], (2, 4))]},
            {"micro_batch_size": 2, "num_micro_batches": 2, "stages": [_stage(["node1/0"], (0, 4))]}],
    }
    for name, pipelines in plans.items():
        save_plan(HERE / name, Plan.model_validate({"schema": "flashflex.plan/1", "inputs": inputs,
                                                    "pipelines": pipelines}))


if __name__ == "__main__":
    main()

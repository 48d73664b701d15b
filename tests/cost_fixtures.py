"""Small clusters and plans for the cost-model tests, built directly from the schema."""

from __future__ import annotations

from typing import Any

from flashflex_cli.hardware.catalog import device_type
from flashflex_cli.hardware.cluster import Cluster
from flashflex_cli.model.spec import ModelSpec
from flashflex_cli.plan.schema import Plan, TrainConfig


def device(type_name: str, slowdown: float = 1.0, **extra: Any) -> dict[str, Any]:
    """A catalog device as a cluster-file dict."""
    entry = device_type(type_name)
    return {"type": entry.name, "memory_bytes": entry.memory_bytes, "peak_flops": dict(entry.peak_flops),
            "memory_bandwidth": entry.memory_bandwidth, "slowdown": slowdown, **extra}


def cluster(*nodes: tuple[str, int, str, str], **inter: Any) -> Cluster:
    """nodes: (device type, count, nic, intra link kind); node names node0, node1, ..."""
    return Cluster.model_validate({
        "name": "test",
        "nodes": [{"name": f"node{i}", "nic": nic, "devices": [device(t)] * n, "intra_link": {"kind": link}}
                  for i, (t, n, nic, link) in enumerate(nodes)],
        "inter_node": inter,
    })


def stage(devices: list[str], lo: int, hi: int) -> dict[str, Any]:
    """A stage dict: a TP group of `devices` running layers [lo, hi)."""
    return {"devices": devices, "tp": len(devices), "layers": [lo, hi]}


def plan(c: Cluster, model: ModelSpec, train: TrainConfig, pipelines: list[tuple[int, list[dict[str, Any]]]],
         mbs: int | None = None) -> Plan:
    """A Plan from (num_micro_batches, stages) per pipeline."""
    return Plan.model_validate({
        "inputs": {"cluster_sha256": c.sha256(), "model": model.model_dump(), "train": train.model_dump()},
        "pipelines": [{"micro_batch_size": mbs or 1, "num_micro_batches": m, "stages": st}
                      for m, st in pipelines],
    })

"""Speed of `estimate(plan, cluster)` on a 1024-device asymmetric plan (target: well under 50 ms).

Builds 128 nodes of 8 GPUs (64 A100 nodes on InfiniBand, 64 RTX 4090 nodes on Ethernet) and a plan of
llama2-70b with 32 pipelines of 4 TP-8 stages. Prints the first call on a fresh cluster object (cold
caches), the median of later calls (warm caches: the planner's situation), and their ratio.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_estimate_speed.py
"""

from __future__ import annotations

import statistics
import time

from flashflex_cli.cost.estimate import estimate
from flashflex_cli.hardware.catalog import device_type
from flashflex_cli.hardware.cluster import Cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan, TrainConfig


def build_cluster() -> Cluster:
    nodes = []
    for i in range(128):
        entry = device_type("A100-80G-SXM" if i < 64 else "RTX-4090")
        dev = {"type": entry.name, "memory_bytes": entry.memory_bytes, "peak_flops": entry.peak_flops,
               "memory_bandwidth": entry.memory_bandwidth}
        nodes.append({"name": f"node{i}", "nic": "ib" if i < 64 else "eth", "devices": [dev] * 8,
                      "intra_link": {"kind": "nvlink" if i < 64 else "pcie"}})
    return Cluster.model_validate({"name": "bench-1024", "nodes": nodes})


def build_plan(cluster: Cluster) -> Plan:
    model = PRESETS["llama2-70b"]
    pipes = []
    for p in range(32):
        stages = [{"devices": [f"node{4 * p + s}/{i}" for i in range(8)], "tp": 8, "layers": [20 * s, 20 * s + 20]}
                  for s in range(4)]
        pipes.append({"micro_batch_size": 1, "num_micro_batches": 64, "stages": stages})
    train = TrainConfig(global_batch=32 * 64, seq_len=4096, recompute=True)
    return Plan.model_validate({"inputs": {"cluster_sha256": cluster.sha256(), "model": model.model_dump(),
                                           "train": train.model_dump()}, "pipelines": pipes})


def main() -> None:
    cluster = build_cluster()
    plan = build_plan(cluster)
    start = time.perf_counter()
    est = estimate(plan, cluster)
    cold = time.perf_counter() - start
    warm = []
    for _ in range(20):
        start = time.perf_counter()
        estimate(plan, cluster)
        warm.append(time.perf_counter() - start)
    median = statistics.median(warm)
    print(f"1024 devices, {len(plan.pipelines)} pipelines, {len(est.stages)} stages: "
          f"iteration {est.iteration_time_s:.2f} s, MFU {est.mfu:.1%}, fits {est.fits}")
    print(f"estimate: cold {cold * 1e3:.1f} ms, warm median {median * 1e3:.1f} ms "
          f"(cold/warm {cold / median:.1f}x; target < 50 ms)")


if __name__ == "__main__":
    main()

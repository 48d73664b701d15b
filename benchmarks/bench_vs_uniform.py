"""Benchmark (c): flashflex against the `uniform` baseline, predicted tokens/s and the share of idle devices.

`uniform` is the best symmetric Megatron-style DP x PP x TP layout over the same devices, scored by the
same cost model; the ratio is flashflex / uniform per cluster. Two sets of clusters:
- bundled: the profiles in profiles/ (the paper's clusters, Holmes' mixed-NIC cluster, the CPU demo);
- large, two families of 32 to 1024 GPUs in nodes of 8, llama2-7b, global batch max(64, 2 x GPUs), seq 4096, bf16:
  `mixed-N`: A100-80G (InfiniBand) / 4090 / 3090 (Ethernet) / A100-40G (RoCE), the clusters of
  bench_planning_time.py; `eth10-N`: A100-80G / 4090 / 3090 nodes, all on 10 Gbit/s Ethernet (issue 9's setting).
Idle: the share of the cluster's devices a plan leaves unused (`unused_devices`), for both strategies.
Usage: python benchmarks/bench_vs_uniform.py [--sizes 32,128,256,512,1024] [--no-bundled] [--budget S] [--jobs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench_planning_time import mixed_spec  # noqa: E402  (same folder: the large benchmark clusters)
from flashflex_cli.errors import FlashflexError  # noqa: E402
from flashflex_cli.hardware.cluster import Cluster, load_cluster  # noqa: E402
from flashflex_cli.hardware.synthetic import build_cluster  # noqa: E402
from flashflex_cli.model.spec import PRESETS  # noqa: E402
from flashflex_cli.plan.schema import Plan, TrainConfig  # noqa: E402
from flashflex_cli.planner.search import plan_layout  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CASES = (  # profile, model, global batch, seq len, dtype
    ("paper-hetero-1", "llama2-7b", 256, 4096, "bf16"),
    ("paper-hetero-2", "llama2-7b", 256, 4096, "bf16"),
    ("paper-hetero-2", "llama2-13b", 256, 4096, "bf16"),
    ("paper-hetero-3", "llama2-7b", 512, 4096, "bf16"),
    ("paper-hetero-3", "llama2-13b", 512, 4096, "bf16"),
    ("holmes-mixed-nic", "llama2-13b", 256, 4096, "bf16"),
    ("paper-homo-a100-2x8", "llama2-7b", 128, 4096, "bf16"),
    ("paper-homo-a100-4x8", "llama2-13b", 256, 4096, "bf16"),
    ("cpu-emulated", "llama-small", 16, 128, "fp32"),
)


ETH10_TYPES = ("A100-80G-SXM", "RTX-4090", "RTX-3090")


def eth10_spec(devices: int) -> str:
    """`devices` GPUs in nodes of 8 cycling through A100-80G / 4090 / 3090, every node on 10 Gbit/s Ethernet."""
    return ",".join(f"1x8x{ETH10_TYPES[n % len(ETH10_TYPES)]}:nic=eth:bw=10" for n in range(max(1, devices // 8)))


def idle_share(plan: Plan, cluster: Cluster) -> float:
    """Fraction of the cluster's devices the plan leaves unused (0..1)."""
    return len(plan.unused_devices) / max(1, len(cluster.device_ids))


Row = tuple[float | None, float, float | None]  # ratio, flashflex idle share, uniform idle share


def _figures(plan: Plan) -> dict[str, Any]:
    """The plan's predicted figures by name (none without a prediction)."""
    return plan.predicted.model_dump() if plan.predicted else {}


def compare(name: str, cluster: Cluster, model: str, train: TrainConfig, budget_s: float, jobs: int) -> Row:
    """Plan both ways and print one row; (ratio, flashflex idle share, uniform idle share), the uniform parts
    None when no uniform layout exists."""
    t0 = time.perf_counter()
    ours = plan_layout(cluster, PRESETS[model], train, time_budget_s=budget_s, jobs=jobs)
    seconds = time.perf_counter() - t0
    a, idle_a = _figures(ours), idle_share(ours, cluster)
    try:
        base = plan_layout(cluster, PRESETS[model], train, strategy="uniform")
    except FlashflexError as exc:
        print(f"{name:<20} {model:<11} {a['tokens_per_s']:>15,.0f} {a['mfu'] * 100:>5.1f}% {idle_a:>5.0%} "
              f"uniform: {exc}", flush=True)
        return None, idle_a, None
    b, idle_b = _figures(base), idle_share(base, cluster)
    ratio = a["tokens_per_s"] / b["tokens_per_s"]
    print(f"{name:<20} {model:<11} {a['tokens_per_s']:>15,.0f} {a['mfu'] * 100:>5.1f}% {idle_a:>5.0%} "
          f"{b['tokens_per_s']:>14,.0f} {b['mfu'] * 100:>5.1f}% {idle_b:>5.0%} {ratio:>5.2f}x {seconds:>7.2f}",
          flush=True)
    return ratio, idle_a, idle_b


def summary(label: str, rows: list[Row]) -> None:
    """One line per cluster set: ratio range and median (where uniform exists), mean idle share of each
    strategy (flashflex over every row, uniform over the rows it has)."""
    if not rows:
        return
    ratios = [r[0] for r in rows if r[0] is not None]
    uniform_idle = [r[2] for r in rows if r[2] is not None]
    line = f"{label}: "
    if ratios:
        line += (f"ratio flashflex / uniform min {min(ratios):.2f}x, median {statistics.median(ratios):.2f}x, "
                 f"max {max(ratios):.2f}x ({len(ratios)} of {len(rows)} with a uniform layout); ")
    line += (f"idle devices flashflex mean {statistics.fmean(r[1] for r in rows):.0%} (max "
             f"{max(r[1] for r in rows):.0%})")
    if uniform_idle:
        line += f", uniform mean {statistics.fmean(uniform_idle):.0%}"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,128,256,512,1024", help="GPUs of the large clusters (empty: none)")
    parser.add_argument("--no-bundled", action="store_true", help="skip the bundled profiles")
    parser.add_argument("--budget", type=float, default=120.0, help="planner time budget per cluster (s)")
    parser.add_argument("--jobs", type=int, default=1, help="planner worker processes")
    args = parser.parse_args()
    print(f"{'cluster':<20} {'model':<11} {'flashflex tok/s':>15} {'MFU':>6} {'idle':>5} {'uniform tok/s':>14} "
          f"{'MFU':>6} {'idle':>5} {'ratio':>6} {'plan s':>7}")
    bundled: list[Row] = []
    if not args.no_bundled:
        for profile, model, batch, seq, dtype in CASES:
            cluster = load_cluster(REPO / "profiles" / f"{profile}.json")
            bundled.append(compare(profile, cluster, model, TrainConfig(global_batch=batch, seq_len=seq, dtype=dtype),
                                   args.budget, args.jobs))
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    large: dict[str, list[Row]] = {"mixed": [], "eth10": []}
    for family, spec in (("mixed", mixed_spec), ("eth10", eth10_spec)):
        for size in sizes:
            cluster = build_cluster(spec(size), name=f"{family}-{size}")
            large[family].append(compare(f"{family}-{size}", cluster, "llama2-7b",
                                         TrainConfig(global_batch=max(64, 2 * size), seq_len=4096), args.budget,
                                         args.jobs))
    summary("bundled", bundled)
    for family, rows in large.items():
        summary(f"large {family}", rows)
    print(f"load {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()

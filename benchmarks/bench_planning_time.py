"""Benchmark (a): planning time against cluster size, 8 / 32 / 128 / 512 / 1024 devices of mixed types.

Targets on the 2-core CI machine: 128 devices under 5 s, 1024 devices under 60 s (wall time; the CPU
time of the planning process is printed too, since a loaded machine inflates wall time). The baseline in the
same run is the `uniform` strategy (a closed-form sweep of symmetric layouts); the ratio shows what the
full search costs on top. Usage: python benchmarks/bench_planning_time.py [--sizes 8,32,128]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from flashflex_cli.hardware.synthetic import build_cluster  # noqa: E402
from flashflex_cli.model.spec import PRESETS  # noqa: E402
from flashflex_cli.plan.schema import TrainConfig  # noqa: E402
from flashflex_cli.planner.search import SearchStats, plan_layout  # noqa: E402

TYPES = ("A100-80G-SXM:nic=ib:link=nvlink", "RTX-4090:nic=eth", "RTX-3090:nic=eth", "A100-40G-SXM:nic=roce")
TARGETS = {128: 5.0, 1024: 60.0}


def mixed_spec(devices: int) -> str:
    """`devices` devices in nodes of 8 (or one smaller node), cycling through four device types."""
    per_node = min(8, devices)
    nodes = devices // per_node
    groups = [f"1x{per_node}x{TYPES[n % len(TYPES)].split(':')[0]}:{TYPES[n % len(TYPES)].split(':', 1)[1]}"
              for n in range(nodes)]
    return ",".join(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32,128,512,1024")
    parser.add_argument("--model", default="llama2-7b")
    parser.add_argument("--budget", type=float, default=60.0, help="--time-budget given to the planner (s)")
    args = parser.parse_args()
    model = PRESETS[args.model]
    print(f"{'devices':>8} {'flashflex s':>12} {'cpu s':>7} {'uniform s':>10} {'ratio':>7} {'candidates':>10} "
          f"{'tokens/s':>12} {'vs uniform':>10} {'budget hit':>10} {'target':>8}")
    for size in (int(s) for s in args.sizes.split(",")):
        cluster = build_cluster(mixed_spec(size), name=f"mixed-{size}")
        train = TrainConfig(global_batch=max(64, 2 * size), seq_len=4096)
        stats = SearchStats()
        c0, t0 = time.process_time(), time.perf_counter()
        plan = plan_layout(cluster, model, train, time_budget_s=args.budget, stats=stats)
        c1, t1 = time.process_time(), time.perf_counter()
        try:
            base = plan_layout(cluster, model, train, strategy="uniform")
            base_tps = base.predicted["tokens_per_s"]
        except Exception:  # noqa: BLE001 - no symmetric layout fits: report it, keep benchmarking
            base_tps = float("nan")
        t2 = time.perf_counter()
        target = TARGETS.get(size)
        verdict = "" if target is None else (
            f"wall {'ok' if t1 - t0 < target else 'MISSED'}, cpu {'ok' if c1 - c0 < target else 'MISSED'} <{target:g}s")
        tps = plan.predicted["tokens_per_s"]
        print(f"{size:>8} {t1 - t0:>12.2f} {c1 - c0:>7.2f} {t2 - t1:>10.2f} {(t1 - t0) / max(t2 - t1, 1e-9):>7.1f} "
              f"{stats.candidates:>10} {tps:>12,.0f} {tps / base_tps:>9.2f}x {str(stats.budget_hit):>10} {verdict:>8}",
              flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at the end: {load:.1f} on {os.cpu_count()} CPUs (wall time grows with load; the planner "
          f"is single-threaded, so its CPU time is what an idle machine's wall time would be)")


if __name__ == "__main__":
    main()

"""Benchmark (b): flashflex against `exhaustive` on random small clusters (predicted tokens/s).

Targets: median within 3% of the optimum, worst within 10%. Clusters on which no layout fits (the
planner says so, exit 2) are reported and replaced by new random ones. `exhaustive` enumerates the planner's whole
space (at most 12 devices); both are ranked by the same cost model. Usage:
python benchmarks/bench_quality.py [--clusters 12] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from flashflex_cli.errors import InfeasibleError  # noqa: E402
from flashflex_cli.hardware.synthetic import build_cluster  # noqa: E402
from flashflex_cli.model.spec import PRESETS  # noqa: E402
from flashflex_cli.plan.schema import TrainConfig  # noqa: E402
from flashflex_cli.planner.search import plan_layout  # noqa: E402

TYPES = ("A100-80G-SXM", "A100-40G-SXM", "RTX-4090", "RTX-3090", "L40S", "V100-32G", "A10")
NICS = ("ib", "roce", "eth")


def random_spec(rng: random.Random, max_devices: int) -> str:
    """2-3 nodes of 1-4 devices each, random types and NICs, at most `max_devices` devices."""
    groups, total = [], 0
    for _ in range(rng.randint(2, 3)):
        count = rng.randint(1, min(4, max_devices - total))
        groups.append(f"1x{count}x{rng.choice(TYPES)}:nic={rng.choice(NICS)}")
        total += count
        if total >= max_devices:
            break
    return ",".join(groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-devices", type=int, default=10)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    gaps = []
    print(f"{'cluster':<62} {'model':<11} {'flashflex tok/s':>15} {'optimum tok/s':>14} {'gap':>7} "
          f"{'ff s':>6} {'exh s':>7}")
    while len(gaps) < args.clusters:
        spec = random_spec(rng, args.max_devices)
        model = rng.choice(("llama2-7b", "llama-1b"))
        train = TrainConfig(global_batch=rng.choice((16, 32, 64)), seq_len=rng.choice((1024, 2048, 4096)))
        cluster = build_cluster(spec)
        t0 = time.perf_counter()
        try:
            ours = plan_layout(cluster, PRESETS[model], train, time_budget_s=60)
        except InfeasibleError as exc:
            print(f"{spec:<62} {model:<11} skipped: {exc}", flush=True)
            continue
        t1 = time.perf_counter()
        best = plan_layout(cluster, PRESETS[model], train, strategy="exhaustive", time_budget_s=3600)
        t2 = time.perf_counter()
        a, b = ours.predicted.tokens_per_s, best.predicted.tokens_per_s
        gap = (b - a) / b * 100
        gaps.append(gap)
        print(f"{spec:<62} {model:<11} {a:>15,.0f} {b:>14,.0f} {gap:>6.2f}% {t1 - t0:>6.2f} {t2 - t1:>7.2f}",
              flush=True)
    median, worst = statistics.median(gaps), max(gaps)
    print(f"median gap {median:.2f}% (target <= 3%: {'ok' if median <= 3 else 'MISSED'}), "
          f"worst {worst:.2f}% (target <= 10%: {'ok' if worst <= 10 else 'MISSED'}); ratio flashflex/optimum "
          f"median {1 - median / 100:.3f}")


if __name__ == "__main__":
    main()

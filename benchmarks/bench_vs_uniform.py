"""Benchmark (c): flashflex against the `uniform` baseline on the bundled profiles (predicted tokens/s).

`uniform` is the best symmetric Megatron-style DP x PP x TP layout over the same devices, scored by the
same cost model; the ratio is flashflex / uniform per profile. Usage: python benchmarks/bench_vs_uniform.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from flashflex_cli.errors import FlashflexError  # noqa: E402
from flashflex_cli.hardware.cluster import load_cluster  # noqa: E402
from flashflex_cli.model.spec import PRESETS  # noqa: E402
from flashflex_cli.plan.schema import TrainConfig  # noqa: E402
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


def main() -> None:
    print(f"{'profile':<20} {'model':<11} {'flashflex tok/s':>15} {'MFU':>6} {'uniform tok/s':>14} {'MFU':>6} "
          f"{'ratio':>6} {'plan s':>7}")
    ratios = []
    for profile, model, batch, seq, dtype in CASES:
        cluster = load_cluster(REPO / "profiles" / f"{profile}.json")
        train = TrainConfig(global_batch=batch, seq_len=seq, dtype=dtype)
        t0 = time.perf_counter()
        ours = plan_layout(cluster, PRESETS[model], train, time_budget_s=120)
        seconds = time.perf_counter() - t0
        a = ours.predicted
        try:
            b = plan_layout(cluster, PRESETS[model], train, strategy="uniform").predicted
        except FlashflexError as exc:
            print(f"{profile:<20} {model:<11} {a['tokens_per_s']:>15,.0f} {a['mfu'] * 100:>5.1f}% "
                  f"uniform: {exc}")
            continue
        ratio = a["tokens_per_s"] / b["tokens_per_s"]
        ratios.append(ratio)
        print(f"{profile:<20} {model:<11} {a['tokens_per_s']:>15,.0f} {a['mfu'] * 100:>5.1f}% "
              f"{b['tokens_per_s']:>14,.0f} {b['mfu'] * 100:>5.1f}% {ratio:>5.2f}x {seconds:>7.2f}", flush=True)
    if ratios:
        print(f"ratio flashflex / uniform: min {min(ratios):.2f}x, max {max(ratios):.2f}x")


if __name__ == "__main__":
    main()

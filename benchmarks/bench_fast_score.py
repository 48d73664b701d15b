"""Benchmark: the planner's fast score against the cost model it stands in for, on DP-heavy clusters.

The search ranks thousands of candidates by a fast score (`planner.scoring.candidate.score`: every pipeline's time
under its batch share and the data-parallel reduction, `planner.scoring.dp_score`) and only its finalists by
`cost.estimate`. A candidate the fast score over-charges never reaches the finalists, so the score has to
charge what the runtime does: per-layer reduction overlapped with the backward, hierarchical across nodes.
Per cluster, 40 candidates spread over the search's whole ranking (every n-th) are scored twice and set
against `cost.estimate`'s iteration time:
- baseline (measured in the same run): the fast score with a flat reduction started after the whole backward
  (`dp_overlap=False, dp_hierarchical=False` on the fast side only; what the planner charged before);
- fast score: with the runtime's schedule (the defaults, as `estimate`).
Printed per cluster: median and largest |score / estimate - 1|, and the rank correlation (Spearman) of each
score with the estimate. Wall and CPU time and the load average beside.
Usage: python benchmarks/bench_fast_score.py [--sample 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from bench_planning_time import mixed_spec  # noqa: E402  (same folder: the large benchmark clusters)
from flashflex_cli.cost.estimate import estimate  # noqa: E402
from flashflex_cli.hardware.cluster import Cluster, load_cluster  # noqa: E402
from flashflex_cli.hardware.synthetic import build_cluster  # noqa: E402
from flashflex_cli.model.spec import PRESETS  # noqa: E402
from flashflex_cli.plan.schema import TrainConfig  # noqa: E402
from flashflex_cli.planner.scoring.candidate import build_plan, score  # noqa: E402
from flashflex_cli.planner.scoring.cost_cache import CostCache  # noqa: E402
from flashflex_cli.planner.search import scored_candidates  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def eth10_spec(devices: int) -> str:
    """A100-80G / 4090 / 3090 nodes of 8, all on 10 Gbit/s Ethernet (bench_vs_uniform's eth10 family)."""
    kinds = ("A100-80G-SXM", "RTX-4090", "RTX-3090")
    return ",".join(f"1x8x{kinds[n % 3]}:nic=eth:bw=10" for n in range(devices // 8))


def cases() -> list[tuple[str, Cluster, str, int]]:
    """(label, cluster, model, global batch) of every benchmarked cluster (seq len 4096, bf16)."""
    out = []
    for n in (32, 128, 256):
        out.append((f"mixed-{n}", build_cluster(mixed_spec(n), name=f"mixed-{n}"), "llama2-7b", max(64, 2 * n)))
        out.append((f"eth10-{n}", build_cluster(eth10_spec(n), name=f"eth10-{n}"), "llama2-7b", max(64, 2 * n)))
    fabrics = "2x8xH100-SXM:nic=ib,2x8xA100-80G-PCIe:nic=roce,2x8xL40S:nic=eth,1x8xV100-32G:nic=eth"
    out.append(("h100-a100-l40s-v100", build_cluster(fabrics, name="fabrics-56"), "llama2-13b", 256))
    for profile, model in (("paper-hetero-1", "llama2-7b"), ("paper-hetero-3", "llama2-13b"),
                           ("holmes-mixed-nic", "llama2-13b")):
        out.append((profile, load_cluster(REPO / "profiles" / f"{profile}.json"), model, 256))
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long samples (ties broken by position)."""
    ra = np.argsort(np.argsort(a, kind="stable"), kind="stable")
    rb = np.argsort(np.argsort(b, kind="stable"), kind="stable")
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(cluster: Cluster, model: str, batch: int, sample: int) -> tuple[list[float], list[float], list[float]]:
    """(estimate, baseline score, fast score) in seconds for `sample` candidates spread over the ranking."""
    train = TrainConfig(global_batch=batch, seq_len=4096)
    cache, cands = scored_candidates(cluster, PRESETS[model], train)
    flat = CostCache(cache.graph, cache.model, cache.train,
                     dataclasses.replace(cache.params, dp_overlap=False, dp_hierarchical=False), cache.micro_batch)
    total = train.global_batch // cache.micro_batch
    truth, base, fast = [], [], []
    for cand in cands[::max(1, len(cands) // sample)][:sample]:
        est = estimate(build_plan(cache, cand, "flashflex", 0, predict=False), cluster, cache.params)
        old = score(flat, cand.pipes, total)
        if not est.fits or old is None:
            continue
        truth.append(est.iteration_time_s)
        base.append(old.score_s)
        fast.append(cand.score_s)
    return truth, base, fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=40, help="candidates per cluster")
    args = parser.parse_args()
    wall0, cpu0, load0 = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    print(f"{'cluster':<22} {'model':<11} {'cands':>5} {'baseline err med/max':>21} {'fast err med/max':>17} "
          f"{'rank corr base/fast':>20}")
    errors_base, errors_fast, rho_base, rho_fast = [], [], [], []
    for label, cluster, model, batch in cases():
        truth, base, fast = measure(cluster, model, batch, args.sample)
        eb = [abs(s / t - 1) for s, t in zip(base, truth, strict=True)]
        ef = [abs(s / t - 1) for s, t in zip(fast, truth, strict=True)]
        rb, rf = spearman(base, truth), spearman(fast, truth)
        errors_base.append(statistics.median(eb))
        errors_fast.append(statistics.median(ef))
        rho_base.append(rb)
        rho_fast.append(rf)
        print(f"{label:<22} {model:<11} {len(truth):>5} {100 * statistics.median(eb):>10.1f}% /{100 * max(eb):>6.1f}% "
              f"{100 * statistics.median(ef):>7.2f}% /{100 * max(ef):>5.1f}% {rb:>11.3f} / {rf:.3f}", flush=True)
    print(f"wall {time.perf_counter() - wall0:.1f} s, CPU {time.process_time() - cpu0:.1f} s, load {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs")
    print(f"bench_fast_score: median error {100 * statistics.median(errors_base):.1f}% -> "
          f"{100 * statistics.median(errors_fast):.2f}% (worst cluster {100 * max(errors_base):.1f}% -> "
          f"{100 * max(errors_fast):.2f}%), rank correlation {statistics.median(rho_base):.3f} -> "
          f"{statistics.median(rho_fast):.3f}")


if __name__ == "__main__":
    main()

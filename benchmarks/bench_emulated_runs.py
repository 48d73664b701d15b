"""Measured, not predicted: the flashflex plan against the uniform plan on emulated CPU clusters.

For each cluster, plans llama-small with both strategies, launches each for a few steps through
`flashflex launch` (gloo processes), and prints the measured median step time and tokens/s of each, their
ratio, and each plan's measured / predicted iteration time. Two clusters:
- `two-cores`: 2 emulated devices, slowdowns 1 and 2, one process per core of a 2-core host: the emulation
  is faithful (each device has its own core).
- `cpu-emulated` (the bundled demo cluster): 4 devices, slowdowns 2,2,4,4, so their total demand is 1.5 cores.
  Emulation is faithful only while the devices' total demand (sum of 1/slowdown, in cores) fits the host:
  processes that compete for cores run slower than the cluster file says, which no cost model of the file
  can predict.
Each emulated device is one intra-op thread pinned to one core (hardware/cpu_share.py). Beside each run:
its launch wall time, the CPU time of its processes (user + system, all ranks and the launcher) and the
1-minute load average before and after it (the host is shared: other load slows the devices down).
Run: .venv/bin/python benchmarks/bench_emulated_runs.py [STEPS] [--cluster two-cores]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLASHFLEX = str(Path(sys.executable).with_name("flashflex"))
CLUSTERS = {"two-cores": "1x2xcpu:slowdown=1,2", "cpu-emulated": str(REPO / "profiles" / "cpu-emulated.json")}
PLAN_ARGS = ["--model", "llama-small", "--global-batch", "16", "--seq-len", "128", "--dtype", "fp32", "--seed", "0"]


def cluster_file(name: str, work: Path) -> Path:
    """The bundled profile, or a synthetic one built with `flashflex profile --synthetic`."""
    source = CLUSTERS[name]
    if source.endswith(".json"):
        return Path(source)
    path = work / f"{name}.json"
    subprocess.run([FLASHFLEX, "profile", "--synthetic", source, "--out", str(path)], check=True, capture_output=True)
    return path


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's finished (waited-for) descendants so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def timed_launch(command: list[str]) -> dict[str, float]:
    """Run `command`; its wall and CPU seconds and the 1-minute load average before and after it."""
    load_before, cpu_before, start = os.getloadavg()[0], children_cpu_s(), time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return {"wall_s": time.perf_counter() - start, "cpu_s": children_cpu_s() - cpu_before,
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def run(cluster: Path, strategy: str, steps: int, work: Path) -> dict[str, float]:
    """Plan with `strategy`, launch it for `steps` steps; measured and predicted figures (seconds, tokens/s),
    and the launch's wall/CPU seconds and load averages (timed_launch)."""
    plan = work / f"{cluster.stem}-{strategy}.json"
    subprocess.run([FLASHFLEX, "plan", str(cluster), *PLAN_ARGS, "--strategy", strategy, "--out", str(plan)],
                   check=True, capture_output=True)
    out = work / f"run-{cluster.stem}-{strategy}"
    launch = timed_launch([FLASHFLEX, "launch", str(plan), "--cluster", str(cluster), "--steps", str(steps),
                           "--out", str(out), "--overwrite", "--no-checkpoint"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(row["step_time_s"] for row in rows[1:])  # the first step is warm-up
    predicted = json.loads(plan.read_text())["predicted"]
    return {"step_s": step_s, "tokens_per_s": statistics.median(row["tokens_per_s"] for row in rows[1:]),
            "predicted_s": predicted["iteration_time_s"], "final_loss": rows[-1]["loss"], **launch}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps", nargs="?", type=int, default=8, help="training steps per run (default 8)")
    parser.add_argument("--cluster", action="append", choices=sorted(CLUSTERS),
                        help="run only this cluster (repeatable; default: all)")
    return parser.parse_args()


def report(name: str, strategy: str, r: dict[str, float]) -> str:
    """One table row: measured vs predicted step, then the launch's wall/CPU seconds and load averages."""
    return (f"{name:13s} {strategy:10s} {1e3 * r['step_s']:11.1f} ms {r['tokens_per_s']:9,.0f} "
            f"{1e3 * r['predicted_s']:7.1f} ms {r['step_s'] / r['predicted_s']:9.2f} {r['final_loss']:8.4f} "
            f"{r['wall_s']:7.1f} s {r['cpu_s']:7.1f} s {r['load_before']:5.2f}->{r['load_after']:.2f}")


def main() -> None:
    args = parse_args()
    print(f"{'cluster':13s} {'strategy':10s} {'measured step':>14s} {'tokens/s':>9s} {'predicted':>10s} "
          f"{'meas/pred':>9s} {'loss@' + str(args.steps):>8s} {'wall':>9s} {'cpu':>9s} load(1m)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cluster or CLUSTERS:
            cluster = cluster_file(name, Path(tmp))
            results = {s: run(cluster, s, args.steps, Path(tmp)) for s in ("flashflex", "uniform")}
            for strategy, r in results.items():
                print(report(name, strategy, r))
            ff, uni = results["flashflex"], results["uniform"]
            print(f"{name:13s} measured tokens/s flashflex / uniform: {ff['tokens_per_s'] / uni['tokens_per_s']:.2f}x "
                  f"(predicted {uni['predicted_s'] / ff['predicted_s']:.2f}x); same losses: "
                  f"{abs(ff['final_loss'] - uni['final_loss']) <= 1e-4 * abs(uni['final_loss'])}")


if __name__ == "__main__":
    main()

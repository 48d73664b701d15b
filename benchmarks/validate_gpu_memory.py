"""Replay recorded GPU runs through `flashflex show --run`: predicted against measured peak memory and step time.

Every run folder under data/gpu-runs/ (and any run folder given on the command line) is predicted afresh by the
cost model (charged by the runtime paths its runtime.json records, legacy paths for what it does not) from its
own plan.json and cluster.json, and set beside what it measured: the allocated peak (torch.cuda.
max_memory_allocated, largest over the run's ranks, median over its steps after the first) and the median step
time. A run that died (a FAILED.txt beside its plan, no metrics) counts for the out-of-memory check only: the
model must not have predicted that its plan fits. `--layers FILE` adds the predictions with that layer profile.

Figures: per run, predicted and measured memory (GiB) and step time (ms) and their errors; then the median and
worst absolute memory error, the median absolute step-time error, and oom-safe: "yes" when no recorded run that
died of memory was predicted to fit. The machine is not used (no GPU is needed): wall and CPU time of the replay
and the load average are printed beside the figures.

Last line, exactly: `validate_gpu_memory: N runs, memory median X%, worst Y%, time median Z%, oom-safe yes|no`
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from flashflex_cli.errors import FlashflexError  # noqa: E402

RECORDS = REPO / "data" / "gpu-runs"


@dataclass(frozen=True)
class Replay:
    """One recorded run against its prediction (bytes, seconds); measured None for a run that died."""

    name: str
    predicted_bytes: float
    measured_bytes: float | None
    predicted_step_s: float
    measured_step_s: float | None
    fits: bool
    died: bool

    @property
    def memory_error(self) -> float | None:
        return None if self.measured_bytes is None else self.predicted_bytes / self.measured_bytes - 1

    @property
    def time_error(self) -> float | None:
        return None if self.measured_step_s is None else self.predicted_step_s / self.measured_step_s - 1


def run_folders(extra: list[Path], records: bool = True) -> list[Path]:
    """Every recorded run folder (holding metrics.jsonl or FAILED.txt beside plan.json) unless not `records`,
    then `extra`."""
    found = sorted(p.parent for p in RECORDS.glob("*/*/plan.json")
                   if (p.parent / "metrics.jsonl").is_file() or (p.parent / "FAILED.txt").is_file()) if records else []
    return found + [p for p in extra if p not in found]


def replay(folder: Path, layers: list[Path]) -> Replay:
    """Predict the run in `folder` (its plan and cluster, its recorded runtime paths) and read what it measured."""
    from flashflex_cli.commands.planning import _cost_params
    from flashflex_cli.cost.estimate import estimate
    from flashflex_cli.hardware.cluster import load_cluster
    from flashflex_cli.plan.schema import load_plan
    from flashflex_cli.runs.compare import compare_run
    from flashflex_cli.runs.paths import params_for_run
    from flashflex_cli.runs.reader import load_run

    plan, cluster = load_plan(folder / "plan.json"), load_cluster(folder / "cluster.json")
    params = params_for_run(_cost_params(None, layers or None, plan), folder, plan, cluster)
    est = estimate(plan, cluster, params)
    peak = max(st.memory.allocated if st.on_cuda else st.memory.total for st in est.stages)
    name = f"{folder.parent.name}/{folder.name}"
    metrics = folder / "metrics.jsonl"
    if (folder / "FAILED.txt").is_file() and (not metrics.is_file() or not metrics.stat().st_size):
        return Replay(name, peak, None, est.iteration_time_s, None, est.fits, died=True)
    comparison = compare_run(plan, est, load_run(folder, plan=plan, cluster=cluster))
    memory = [t.measured for c in comparison.stages for t in c.terms if t.name == "memory" and t.measured]
    return Replay(name, peak, max(memory) if memory else None, est.iteration_time_s, comparison.measured_step_s,
                  est.fits, died=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help="more run folders of `flashflex launch --out`")
    parser.add_argument("--layers", action="append", type=Path, default=[],
                        help="also predict with this layer profile (flashflex.layers/1); repeatable")
    parser.add_argument("--no-records", action="store_true", help="only the run folders given, not data/gpu-runs")
    args = parser.parse_args(argv)
    try:
        return _replay_all(args)
    except FlashflexError as exc:  # a run folder without its plan or cluster, a bad layer profile: one line
        print(f"validate_gpu_memory: {exc}", file=sys.stderr)
        return exc.exit_code


def _replay_all(args: argparse.Namespace) -> int:
    """Print the replays of every run folder and the summary lines (module docstring)."""
    wall, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    folders = run_folders(args.runs, records=not args.no_records)
    variants = [("analytic", [])] + ([("profile", args.layers)] if args.layers else [])
    results = [(label, [replay(f, layers) for f in folders]) for label, layers in variants]  # all read first
    summary = None
    for label, replays in results:
        print(f"{label} model:")
        for r in replays:
            if r.died:
                verdict = "predicted NOT to fit: safe" if not r.fits else "predicted to fit: UNSAFE"
                print(f"  {r.name:28s} died of memory; {r.predicted_bytes / 2**30:6.2f} GiB predicted, {verdict}")
                continue
            print(f"  {r.name:28s} memory {r.predicted_bytes / 2**30:6.2f} GiB predicted, "
                  f"{(r.measured_bytes or 0) / 2**30:6.2f} measured ({100 * (r.memory_error or 0):+5.1f}%); step "
                  f"{1e3 * r.predicted_step_s:7.1f} ms predicted, {1e3 * (r.measured_step_s or 0):7.1f} measured "
                  f"({100 * (r.time_error or 0):+5.1f}%)")
        measured = [r for r in replays if not r.died]
        memory = [abs(r.memory_error) for r in measured if r.memory_error is not None]
        times = [abs(r.time_error) for r in measured if r.time_error is not None]
        safe = all(not r.fits for r in replays if r.died)
        line = (f"validate_gpu_memory: {len(replays)} runs, memory median {100 * statistics.median(memory):.1f}%, "
                f"worst {100 * max(memory):.1f}%, time median {100 * statistics.median(times):.1f}%, "
                f"oom-safe {'yes' if safe else 'no'}")
        print(f"  {label}: {line.split(': ', 1)[1]}")
        summary = summary or line  # the last line reports the analytic model
    print(f"replayed in {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU; "
          f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

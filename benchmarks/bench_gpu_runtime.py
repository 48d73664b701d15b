"""GPU speed of the flashflex runtime on one GPU, against the training loop a user would write instead.

In one run on the same GPU, same model shape, dtype (bf16 autocast over fp32 weights), micro-batch size and
sequences per step (default: `llama-1b`, seq 2048, micro-batch 4, 16 sequences per step, i.e. 4 micro-batches
accumulated per optimizer step), it measures:
- "hf eager": a plain Hugging Face `transformers` `LlamaForCausalLM` (built from a config, SDPA attention,
  random weights: nothing is downloaded) trained by the usual loop: `model(input_ids, labels).loss` per
  micro-batch (transformers shifts the labels, so it predicts seq - 1 tokens of each sequence), gradient
  accumulation, `clip_grad_norm_`, `torch.optim.AdamW(fused=True)`;
- "hf compiled": the same loop with `torch.compile(model)` (the whole model as one graph);
- "flashflex engine": `RankEngine` of a one-rank plan in this process, with the runtime's default paths
  (compiled, compile scope "auto": the whole stage one graph at TP 1; chunked loss; fused AdamW); with
  `--ablations` also each path switched off (`--no-compile`, `--no-chunked-loss`, `--optimizer foreach`) and all
  three off (the recorded runs' paths), and the paths issue 31 added: the compile per block
  (`compile_scope=block`, against the default's whole-stage graph: the figure semantics/runtime_paths.
  stage_compile_scope's rule rests on), the weights cast once per step (`cast_once`), and torch's fused linear
  cross-entropy as the loss (`loss_kernel=torch`); each with its compile seconds beside its step time;
- "flashflex launch": `flashflex launch` of the same one-rank plan (a worker process; its metrics.jsonl).
Each row: median step time over `--steps` timed steps after `--warmup` untimed ones (compilation happens in
these, or in the engine's warm-up before step 0, and is reported beside), tokens/s (sequences x seq per step),
MFU (model FLOPs 6N + 12 L s h per token over the GPU's dense bf16 peak from the device catalog), peak memory
(torch.cuda.max_memory_allocated over the variant; the launch's from its metrics), and, as the project's
benchmarks do, the variant's wall and CPU time (this process and its children) with the load average.
Ratios are against "hf compiled". `--trace FILE`: after timing each variant, one more step under torch.profiler,
and the 40 CUDA kernels with the most total time (on the CPU smoke run, the 40 CPU operators with the most self
time, so the path is testable) written to FILE, one section per variant, so a GPU run leaves a kernel-level
record beside its table. The last line, exactly:
`bench_gpu_runtime: flashflex/hf-compiled X.XXx tokens/s, memory Y.YYx` (the engine's figures; the launch's
ratios are printed on the line before it).

    python benchmarks/bench_gpu_runtime.py [--model llama-1b] [--seq 2048] [--micro-batch 4] [--sequences 16]
        [--steps 10] [--warmup 3] [--ablations] [--skip-launch] [--peak-tflops T] [--trace FILE]

Without CUDA it prints why and exits 0, measuring nothing. `--smoke` runs every code path on the CPU with a tiny
model and torch.compile's cheap "aot_eager" backend (a check of the script, not a measurement; memory is not
tracked there).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 2**30


@dataclass
class Row:
    """One measured variant: median step seconds, peak memory bytes (None: not tracked), compile warm-up
    seconds where reported, wall and CPU seconds of the whole variant."""

    label: str
    step_s: float
    memory_bytes: int | None
    compile_s: float | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def last_line(tokens_ratio: float, memory_ratio: float | None) -> str:
    """The benchmark's last line (memory "n/a" where it was not tracked: the CPU smoke run)."""
    memory = f"{memory_ratio:.2f}x" if memory_ratio is not None else "n/a"
    return f"bench_gpu_runtime: flashflex/hf-compiled {tokens_ratio:.2f}x tokens/s, memory {memory}"


def ratios(row: Row, base: Row) -> tuple[float, float | None]:
    """(tokens/s of `row` over `base`, peak memory of `row` over `base`, None where either is untracked)."""
    memory = None if row.memory_bytes is None or not base.memory_bytes else row.memory_bytes / base.memory_bytes
    return base.step_s / row.step_s, memory


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children so far."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


class Bench:
    """The run's settings and shared state: device, plan, batch, peak FLOP/s."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from flashflex_cli.model.flops import model_flops_per_token
        from flashflex_cli.model.spec import PRESETS

        self.args = args
        self.gpu = not args.smoke
        self.device = torch.device("cuda", 0) if self.gpu else torch.device("cpu")
        self.spec = PRESETS[args.model]
        if args.sequences % args.micro_batch:
            sys.exit(f"bench_gpu_runtime: --sequences {args.sequences} is not a multiple of --micro-batch "
                     f"{args.micro_batch}")
        self.micro = args.sequences // args.micro_batch
        self.tokens_per_step = args.sequences * args.seq
        self.flops_per_token = model_flops_per_token(self.spec, args.seq)
        self.backend = "aot_eager" if args.smoke else "inductor"
        generator = torch.Generator().manual_seed(0)
        self.batch = torch.randint(0, self.spec.vocab_size, (args.sequences, args.seq + 1), generator=generator)
        self.device_type = self._catalog_type()
        self.peak = self._peak_flops()

    def _catalog_type(self) -> str | None:
        """The device catalog's type of GPU 0 ("cpu" for the smoke run; None when the catalog lacks it)."""
        import torch

        if not self.gpu:
            return "cpu"
        from flashflex_cli.hardware.probe_local import catalog_match

        return catalog_match(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory)

    def _peak_flops(self) -> float:
        """Dense bf16 peak FLOP/s: --peak-tflops, else the catalog's (1 TFLOP/s assumed in the smoke run)."""
        if self.args.peak_tflops:
            return self.args.peak_tflops * 1e12
        if not self.gpu:
            return 1e12
        if self.device_type is None:
            sys.exit("bench_gpu_runtime: this GPU is not in the device catalog; pass --peak-tflops (and "
                     "--skip-launch: a launch needs a cluster file of a catalog type)")
        from flashflex_cli.hardware.catalog import device_type

        return device_type(self.device_type).peak_flops["bf16"]

    # ---- measuring ----------------------------------------------------------------------------------------

    def sync(self) -> None:
        import torch

        if self.gpu:
            torch.cuda.synchronize()

    def reset_memory(self) -> None:
        import torch

        gc.collect()
        if self.gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_memory(self) -> int | None:
        import torch

        return int(torch.cuda.max_memory_allocated()) if self.gpu else None

    def time_steps(self, step: Callable[[], object]) -> float:
        """Median seconds of `--steps` calls of `step` after `--warmup` untimed ones."""
        for _ in range(self.args.warmup):
            step()
        self.sync()
        times = []
        for _ in range(self.args.steps):
            start = time.perf_counter()
            step()
            self.sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def measure(self, label: str, build: Callable[[], tuple[Callable[[], object], float | None]]) -> Row:
        """Build a variant (returns its step function and compile warm-up seconds), time it, free it. Dynamo's
        caches are emptied first, so each variant's compile seconds are its own, not a reuse of an earlier one's."""
        import torch

        torch._dynamo.reset()
        self.reset_memory()
        wall, cpu = time.perf_counter(), _cpu_s()
        step, compile_s = build()
        seconds = self.time_steps(step)
        row = Row(label, seconds, self.peak_memory(), compile_s, time.perf_counter() - wall, _cpu_s() - cpu)
        if self.args.trace:
            self.trace(label, step)
        del step
        self.reset_memory()
        return row

    def trace(self, label: str, step: Callable[[], object]) -> None:
        """One more call of `step` under torch.profiler; its top 40 kernels appended to `--trace` (module
        docstring)."""
        from torch.profiler import ProfilerActivity, profile

        activity = ProfilerActivity.CUDA if self.gpu else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            step()
            self.sync()
        write_trace(Path(self.args.trace), label, kernel_rows(prof.key_averages(), self.gpu))

    # ---- the variants -------------------------------------------------------------------------------------

    def hf_loop(self, compiled: bool) -> tuple[Callable[[], object], float | None]:
        """The plain transformers training step (module docstring)."""
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        from flashflex_cli.model.hf_config import to_hf_config

        config = LlamaConfig(**{k: v for k, v in to_hf_config(self.spec).items() if k != "architectures"})
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        run = torch.compile(model, backend=self.backend) if compiled else model
        tokens = self.batch.to(self.device)
        mbs = self.args.micro_batch

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            for m in range(self.micro):
                rows = tokens[m * mbs:(m + 1) * mbs, :-1]
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    loss = run(input_ids=rows, labels=rows).loss
                (loss / self.micro).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

        return step, None

    def plan(self, cluster_sha256: str = "bench"):  # noqa: ANN201 - a flashflex Plan
        """The one-rank plan: one stage with every layer, `micro` micro-batches of `--micro-batch`."""
        from flashflex_cli.plan.schema import Plan

        a = self.args
        return Plan.model_validate({
            "schema": "flashflex.plan/1",
            "inputs": {"cluster_sha256": cluster_sha256, "model": self.spec.model_dump(),
                       "train": {"global_batch": a.sequences, "seq_len": a.seq, "micro_batch_size": a.micro_batch,
                                 "dtype": "bf16"}},
            "pipelines": [{"micro_batch_size": a.micro_batch, "num_micro_batches": self.micro,
                           "stages": [{"devices": ["node0/0"], "tp": 1, "layers": [0, self.spec.num_layers]}]}],
        })

    def engine(self, **switches: Any) -> tuple[Callable[[], object], float | None]:
        """flashflex's RankEngine of the one-rank plan with `switches` (RuntimeOptions fields)."""
        from flashflex_cli.runtime.parallel.groups import build_groups
        from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine
        from flashflex_cli.semantics.runtime_paths import RuntimeOptions

        plan = self.plan()
        engine = RankEngine(plan, 0, build_groups(plan, 0), self.device, OptimConfig(lr=1e-4, warmup_steps=1),
                            options=RuntimeOptions(**switches), compile_backend=self.backend)
        batch = self.batch
        return (lambda: engine.train_step(batch)), engine.compile_seconds

    def launch(self, folder: Path) -> Row:
        """`flashflex launch` of the one-rank plan on a one-device cluster of this machine's device type; its
        metrics.jsonl gives the step times (the first `--warmup` left out) and the peak memory."""
        from flashflex_cli.hardware.cluster import save_cluster
        from flashflex_cli.hardware.synthetic import build_cluster

        if self.device_type is None:
            sys.exit("bench_gpu_runtime: this GPU is not in the device catalog; pass --skip-launch")
        cluster = build_cluster(f"1x1x{self.device_type}", name="bench")
        save_cluster(folder / "cluster.json", cluster)
        (folder / "plan.json").write_text(self.plan(cluster.sha256()).to_json())
        steps = self.args.warmup + self.args.steps
        command = [sys.executable, "-m", "flashflex_cli.cli", "launch", str(folder / "plan.json"),
                   "--cluster", str(folder / "cluster.json"), "--steps", str(steps), "--out", str(folder / "run"),
                   "--lr", "1e-4", "--timeout", "900", "--overwrite", "--no-checkpoint"]
        wall, cpu = time.perf_counter(), _cpu_s()
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"bench_gpu_runtime: flashflex launch failed ({done.returncode}):\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
        timed = rows[self.args.warmup:] or rows
        runtime = json.loads((folder / "run" / "runtime.json").read_text())
        memory = max(int(r["memory_bytes"]) for r in rows) if self.gpu else None
        row = Row("flashflex launch", statistics.median(r["step_time_s"] for r in timed), memory,
                  runtime.get("compile_warmup_s"), time.perf_counter() - wall, _cpu_s() - cpu)
        row.notes.append("paths " + ", ".join(f"{k}={v}" for k, v in sorted(runtime.items())
                                              if k != "compile_warmup_s"))
        return row

    # ---- reporting ----------------------------------------------------------------------------------------

    def print_row(self, row: Row, base: Row | None) -> None:
        tps = self.tokens_per_step / row.step_s
        mfu = tps * self.flops_per_token / self.peak
        memory = f"{row.memory_bytes / GIB:6.1f}" if row.memory_bytes is not None else "   n/a"
        compile_s = f"{row.compile_s:6.1f}" if row.compile_s is not None else "     -"
        line = (f"{row.label:32s} {row.step_s * 1e3:8.1f} {tps:10,.0f} {mfu:6.1%} {memory} {compile_s} "
                f"{row.wall_s:7.1f} {row.cpu_s:7.1f}")
        if base is not None:
            speed, mem = ratios(row, base)
            line += f"   {speed:5.2f}x" + (f" {mem:5.2f}x" if mem is not None else "   n/a")
        print(line + ("  " + "; ".join(row.notes) if row.notes else ""), flush=True)


TRACE_ROWS = 40


def kernel_rows(averages: Any, on_gpu: bool) -> list[tuple[str, int, float]]:
    """(name, calls, total seconds) of the TRACE_ROWS kernels (CUDA) or CPU operators with the most self time,
    from torch.profiler's `key_averages()`, most first."""
    def total_us(event: Any) -> float:
        if on_gpu:
            return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))
        return float(event.self_cpu_time_total)

    rows = [(event.key, int(event.count), total_us(event) / 1e6) for event in averages]
    return sorted((row for row in rows if row[2] > 0), key=lambda row: -row[2])[:TRACE_ROWS]


def write_trace(path: Path, label: str, rows: list[tuple[str, int, float]]) -> None:
    """Append one variant's section to the trace file: its kernels' total ms, calls, and share of the listed ones."""
    total = sum(seconds for _, _, seconds in rows) or 1.0
    lines = [f"## {label.strip()}: top {len(rows)} kernels by total time (one step)",
             f"{'ms':>9s} {'calls':>6s} {'share':>6s}  kernel"]
    lines += [f"{seconds * 1e3:9.3f} {calls:6d} {seconds / total:6.1%}  {name[:160]}" for name, calls, seconds in rows]
    with path.open("a") as out:
        out.write("\n".join(lines) + "\n\n")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--sequences", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant (compilation)")
    parser.add_argument("--ablations", action="store_true", help="also the engine with each path switched off")
    parser.add_argument("--skip-launch", action="store_true", help="leave out the `flashflex launch` variant")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the catalog's bf16 peak")
    parser.add_argument("--smoke", action="store_true", help="CPU run of a tiny model to check the script")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="write each variant's top 40 kernels (torch.profiler, one step) to FILE")
    args = parser.parse_args(argv)
    if args.trace:
        trace = Path(args.trace)
        if not trace.parent.is_dir():
            parser.exit(2, f"bench_gpu_runtime: --trace {trace}: folder {trace.parent} does not exist\n")
        trace.write_text("")  # this run's sections only
    if args.smoke:
        args.model, args.seq, args.micro_batch, args.sequences, args.steps, args.warmup = "llama-tiny", 32, 2, 4, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # what `flashflex launch` gives its workers, here for every variant alike (before CUDA starts)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench_gpu_runtime: SKIPPED: needs a CUDA GPU (torch.cuda.is_available() is False); nothing "
              "measured.", file=sys.stderr)
        return 0
    try:
        import transformers
    except ImportError:
        sys.exit("bench_gpu_runtime: needs transformers (a dev dependency: pip install -e '.[dev]')")
    import torch.distributed as dist

    bench = Bench(args)
    if bench.gpu:
        torch.cuda.set_device(bench.device)
    load_before = os.getloadavg()[0]
    store = Path(tempfile.mkdtemp(prefix="bench-gpu-runtime-"))
    dist.init_process_group("nccl" if bench.gpu else "gloo", init_method=f"file://{store / 'store'}", rank=0,
                            world_size=1)
    where = torch.cuda.get_device_name(0) if bench.gpu else "cpu (smoke run, not a measurement)"
    print(f"{args.model}, seq {args.seq}, micro-batch {args.micro_batch}, {args.sequences} sequences per step "
          f"({bench.micro} micro-batches), bf16 autocast over fp32 weights, on {where} (catalog type "
          f"{bench.device_type}, bf16 peak {bench.peak / 1e12:.0f} TFLOP/s"
          f"{', given' if args.peak_tflops else ''}); torch {torch.__version__}, transformers "
          f"{transformers.__version__}", flush=True)
    print(f"{'variant':32s} {'step ms':>8s} {'tokens/s':>10s} {'MFU':>6s} {'GiB':>6s} {'comp s':>6s} "
          f"{'wall s':>7s} {'CPU s':>7s}   vs hf compiled: tokens/s, memory", flush=True)
    hf_eager = bench.measure("hf eager", lambda: bench.hf_loop(False))
    hf_compiled = bench.measure("hf compiled", lambda: bench.hf_loop(True))
    bench.print_row(hf_eager, hf_compiled)
    bench.print_row(hf_compiled, hf_compiled)
    # the smoke run compiles the engine too (on the CPU the runtime's default is eager)
    smoke_compile = {"compile": True} if args.smoke else {}
    engine = bench.measure("flashflex engine", lambda: bench.engine(**smoke_compile))
    bench.print_row(engine, hf_compiled)
    if args.ablations:
        for label, switches in (("  --no-compile", {"compile": False}),
                                ("  --no-chunked-loss", {"chunked_loss": False}),
                                ("  --optimizer foreach", {"optimizer": "foreach"}),
                                ("  all three (recorded runs' paths)",
                                 {"compile": False, "chunked_loss": False, "optimizer": "foreach"}),
                                ("  compile scope block", {"compile_scope": "block", **smoke_compile}),
                                ("  compile scope stage", {"compile_scope": "stage", **smoke_compile}),
                                ("  cast once", {"cast_once": True, **smoke_compile}),
                                ("  loss kernel torch", {"loss_kernel": "torch", **smoke_compile})):
            bench.print_row(bench.measure(label, lambda s=switches: bench.engine(**s)), hf_compiled)
    dist.destroy_process_group()
    launch = None
    if not args.skip_launch:
        launch = bench.launch(store)
        bench.print_row(launch, hf_compiled)
    print(f"host: {os.cpu_count()} cores, load {load_before:.2f} -> {os.getloadavg()[0]:.2f} (1 min)")
    if launch is not None:
        speed, memory = ratios(launch, hf_compiled)
        print(f"flashflex launch/hf-compiled {speed:.2f}x tokens/s, memory "
              f"{f'{memory:.2f}x' if memory is not None else 'n/a'}")
    print(last_line(*ratios(engine, hf_compiled)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU throughput of the flashflex runtime on one rank, against a plain single-GPU torch training loop.

One-rank plan, bf16 autocast, the `llama-1b` preset (Llama 3.2 1B shape), seq 2048. For each attention backend
(SDPA, and flash-attn when installed and supported) it times RankEngine.train_step, then times a plain loop of
the same model (same module, torch.optim.AdamW fused, bf16 autocast, no engine) in the same run, and prints
tokens/s, MFU (model FLOPs 6N + 12*L*s*h per token over the device's dense bf16 peak) and the ratio.

    python benchmarks/bench_gpu_runtime.py [--model llama-1b] [--seq 2048] [--micro-batches 4] [--steps 10]

Exits with a clear message (status 0, nothing measured) on a machine without CUDA. `--smoke` instead runs the
same code paths on the CPU with a tiny model in fp32 (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path


def _peak_flops(torch_mod, override_tflops: float | None) -> tuple[float, str]:  # noqa: ANN001
    if override_tflops:
        return override_tflops * 1e12, "peak given"
    from flashflex_cli.hardware.catalog import device_type

    name = torch_mod.cuda.get_device_name(0)
    try:
        from flashflex_cli.hardware.probe_local import catalog_match
    except ImportError:
        sys.exit("bench_gpu_runtime: cannot map the GPU name to the device catalog; pass --peak-tflops")
    matched = catalog_match(name, torch_mod.cuda.get_device_properties(0).total_memory)
    if matched is None:
        sys.exit(f"bench_gpu_runtime: {name!r} is not in the device catalog; pass --peak-tflops")
    return device_type(matched).peak_flops["bf16"], matched


def _plan(model: str, seq: int, micro: int):  # noqa: ANN202
    from flashflex_cli.model.spec import PRESETS
    from flashflex_cli.plan.schema import Plan

    return Plan.model_validate({
        "schema": "flashflex.plan/1",
        "inputs": {"cluster_sha256": "bench", "model": PRESETS[model].model_dump(),
                   "train": {"global_batch": micro, "seq_len": seq, "micro_batch_size": 1, "dtype": "bf16"}},
        "pipelines": [{"micro_batch_size": 1, "num_micro_batches": micro,
                       "stages": [{"devices": ["gpu0/0"], "tp": 1, "layers": [0, PRESETS[model].num_layers]}]}],
    })


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_steps(step_fn, steps: int, warmup: int) -> float:  # noqa: ANN001
    """Median seconds of `steps` calls after `warmup` calls."""
    for _ in range(warmup):
        step_fn()
    _sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step_fn()
        _sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _plain_loop(spec, batch, micro: int, device):  # noqa: ANN001, ANN202
    """A plain training step: same model, fused torch AdamW, bf16 autocast, gradient accumulation."""
    import torch

    from flashflex_cli.runtime.reference import build_reference

    model = build_reference(spec, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    tokens = batch.to(device)
    count = tokens[:, 1:].numel()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            rows = tokens[m:m + 1]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(rows[:, :-1], rows[:, 1:]) / count
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step, model, opt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the catalog's bf16 peak")
    parser.add_argument("--smoke", action="store_true", help="CPU run of a tiny model to check the script")
    args = parser.parse_args()

    import torch

    if args.smoke:
        args.model, args.seq, args.steps, args.warmup = "llama-tiny", 32, 2, 1
        args.peak_tflops = args.peak_tflops or 1.0
    elif not torch.cuda.is_available():
        print("bench_gpu_runtime: SKIPPED: needs a CUDA GPU (torch.cuda.is_available() is False); nothing "
              "measured.", file=sys.stderr)
        return 0
    import torch.distributed as dist

    from flashflex_cli.model.flops import model_flops_per_token
    from flashflex_cli.runtime.attention import FLASH, SDPA, flash_attn_available
    from flashflex_cli.runtime.engine import OptimConfig, RankEngine
    from flashflex_cli.runtime.groups import build_groups

    peak, device_name = _peak_flops(torch, args.peak_tflops)
    plan = _plan(args.model, args.seq, args.micro_batches)
    if args.smoke:
        plan = plan.model_copy(update={"inputs": plan.inputs.model_copy(update={
            "train": plan.inputs.train.model_copy(update={"dtype": "fp32"})})})
    spec = plan.inputs.model
    tokens_per_step = args.micro_batches * args.seq
    flops_per_token = model_flops_per_token(spec, args.seq)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, spec.vocab_size, (args.micro_batches, args.seq + 1), generator=gen)
    store = Path(tempfile.mkdtemp()) / "store"
    gpu = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{store}", rank=0, world_size=1)
    where = torch.cuda.get_device_name(0) if gpu else "cpu (smoke run, fp32, not a measurement)"
    print(f"{args.model} seq {args.seq}, {args.micro_batches} micro-batches of 1, {plan.inputs.train.dtype}, on "
          f"{where} ({device_name}, bf16 peak {peak / 1e12:.0f} TFLOP/s)")

    plain_step, model, opt = _plain_loop(spec, batch, args.micro_batches, device)
    plain = _time_steps(plain_step, args.steps, args.warmup)
    del model, opt, plain_step
    torch.cuda.empty_cache()

    def report(label: str, seconds: float) -> None:
        tps = tokens_per_step / seconds
        print(f"{label:28s} step {seconds * 1e3:8.1f} ms  {tps:9.0f} tokens/s  MFU {tps * flops_per_token / peak:6.1%}"
              f"  throughput vs plain loop {plain / seconds:5.2f}x")

    report("plain torch loop (sdpa)", plain)
    backends = [SDPA] + ([FLASH] if gpu and flash_attn_available() and torch.cuda.get_device_capability(0) >= (8, 0)
                         else [])
    if FLASH not in backends:
        print("flash-attn: not installed or unsupported here; SDPA only")
    groups = build_groups(plan, 0)
    for backend in backends:
        engine = RankEngine(plan, 0, groups, device, OptimConfig(lr=1e-4, warmup_steps=1), attention=backend)
        seconds = _time_steps(lambda e=engine: e.train_step(batch), args.steps, args.warmup)
        report(f"flashflex engine ({backend})", seconds)
        del engine
        torch.cuda.empty_cache()
    if gpu:
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

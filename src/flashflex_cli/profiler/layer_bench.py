"""Measure one transformer layer, the embedding and the head of a model shape with the runtime's own modules.

For every requested (micro_batch_size, tp) this gives, per micro-batch and per device of the TP group:
forward seconds, backward seconds and `activation_bytes` (what one micro-batch keeps alive until its
backward) of three parts, each a `StageModule` of runtime/model/stage.py:

- layer: one `DecoderLayer` (with activation recompute when asked), input fp32 [b, s, hidden] -> [b, s, hidden];
- embedding: the vocabulary-parallel embedding, int64 tokens [b, s] -> [b, s, hidden];
- head: final RMSNorm + output projection + summed cross-entropy, [b, s, hidden] and targets [b, s] -> scalar.

The parts run on the runtime's paths (`BenchConfig.runtime`, resolved for the device as a run resolves them): the
chunked loss in the head (its kernel, `loss_kernel`), the layer's weights cast once (`cast_once`: the copies made
before anything is timed, as a run makes them once per step), and with compile (default on CUDA) each part
compiled as in a run, under the compile scope a stage of that TP degree takes (runtime/model/compiled.py; a
part is its own stage, so "stage" compiles each part whole; the scope recorded is TP 1's, entries at TP > 1
run per block); the profile's `runtime` records every one of these. Compiled parts are warmed up once on the
first micro-batch size before anything is timed (a compile failure anywhere in the group: every part eager, one warning line); each later micro-batch size compiles in its
first untimed warm-up run (at least one when compiled).

Every TP degree runs in `tp` freshly spawned processes (gloo on CPU, each pinned to one core with
`pin_emulated_device`; NCCL on GPU, one GPU each), so the times include the part's real TP collectives.
Each process builds the three parts once, then for each micro-batch size: `warmup` untimed forward+backward
runs, then `repeats` timed ones. A forward is timed from the aligned start of the group (a barrier) to the
output (CUDA synchronised); the backward is timed separately, from the saved graph with a gradient of the
output's shape. Figures are medians over the repeats, then the max over the ranks of the group.

Memory (bytes):
- CUDA: `activation_bytes` = torch.cuda.memory_allocated after a forward (output kept) minus before it;
  `fixed_bytes` = what stays allocated beside the parts' parameters after the micro-batch's measurements
  (workspaces, rotary tables): the allocator's allocated bytes, never its reserved cache, which grows with the
  largest micro-batch measured (cost/memory.py adds the allocator's slack and the memory outside it itself).
- CPU: `activation_bytes` = bytes of the distinct storages that a forward saves for its backward (seen with
  `torch.autograd.graph.saved_tensors_hooks`) plus its output, leaving out storages that existed before the
  forward (weights, the input, cached rotary tables): two forwards run with the first graph kept alive, and
  only storages new in the second count. `fixed_bytes` is not measured on CPU (None): the process RSS is
  too coarse and too noisy to split from tensor memory.

A micro-batch that runs out of memory on any rank is skipped (reported, left out); the others continue.
"""

from __future__ import annotations

import gc
import queue as queue_module
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import InputError, RuntimeFailure
from ..hardware.cpu_share import pin_emulated_device, usable_cores
from ..hardware.device_sync import synchronize
from ..layers.schema import LayerProfile, ModelShape, PartCost, ProfileEntry, ProfilePaths
from ..model.spec import ModelSpec
from ..runtime.device.slowdown import runqueue_seconds
from ..runtime.model.attention import PLAN_BACKENDS, flash_attn_available
from ..runtime.model.compiled import all_reduce_max, compile_or_fall_back
from ..runtime.model.precision import autocast, autocast_dtype, use_tf32_matmuls
from ..runtime.model.stage import StageModule
from ..runtime.model.tensor_parallel import TPContext
from ..runtime.model.working_weights import WorkingWeights
from ..semantics.runtime_paths import RuntimeOptions, stage_compile_scope

PARTS = ("layer", "embedding", "head")
DTYPES = ("bf16", "fp16", "fp32", "tf32")
INIT_STD = 0.02


@dataclass(frozen=True)
class BenchConfig:
    """What to measure: model shape, sequence length (tokens), micro-batch sizes (sequences), dtype, attention
    ("flash", "sdpa", "eager"), layer recompute, timed repeats and untimed warm-up runs per part, the
    timeout (seconds) of the TP process group's collectives, and the runtime's paths (compile, chunked loss;
    resolved for the device)."""

    spec: ModelSpec
    seq_len: int
    micro_batches: tuple[int, ...]
    dtype: str = "fp32"
    attention: str = "sdpa"
    recompute: bool = False
    repeats: int = 5
    warmup: int = 2
    timeout_s: float = 600.0
    runtime: RuntimeOptions = RuntimeOptions()


@dataclass(frozen=True)
class PartTimes:
    """One part for one micro-batch on one device: seconds forward, seconds backward, bytes kept."""

    fwd_s: float
    bwd_s: float
    activation_bytes: float


@dataclass(frozen=True)
class EntryResult:
    """All three parts at one (micro_batch_size, tp); fixed_bytes None where not measured (CPU)."""

    micro_batch_size: int
    tp: int
    parts: dict[str, PartTimes]
    fixed_bytes: float | None


@dataclass(frozen=True)
class Skipped:
    """A (micro_batch_size, tp) left out, and why (e.g. out of memory)."""

    micro_batch_size: int
    tp: int
    reason: str


# ---------------------------------------------------------------------------------------------- checks (parent)


def devices_available() -> tuple[str, int]:
    """("cuda", GPU count) when CUDA is usable, else ("cpu", usable cores: one emulated device per core)."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return "cuda", torch.cuda.device_count()
    return "cpu", len(usable_cores())


def check_request(config: BenchConfig, tps: tuple[int, ...], kind: str, count: int) -> None:
    """Refuse a request that cannot be measured here (InputError, one line), before spawning anything."""
    _check_numbers(config, tps)
    spec = config.spec
    for tp in tps:
        if not spec.supports_tp(tp):
            raise InputError(f"--tp {tp} does not divide the heads ({spec.num_heads} query, {spec.num_kv_heads} "
                             f"key/value) and the MLP width {spec.intermediate_size} of {spec.name}")
        if tp > count:
            what = "GPUs" if kind == "cuda" else "usable cores (one emulated device each)"
            raise InputError(f"--tp {tp} needs {tp} devices; this machine has {count} {what}")
    _check_dtype(config, kind)


def _check_numbers(config: BenchConfig, tps: tuple[int, ...]) -> None:
    checks = [("--seq-len", config.seq_len), ("--repeats", config.repeats)]
    checks += [("--micro-batch", b) for b in config.micro_batches] + [("--tp", tp) for tp in tps]
    for option, value in checks:
        if value < 1:
            raise InputError(f"{option} must be a positive integer, got {value}")
    if config.warmup < 0:
        raise InputError(f"--warmup must be 0 or more, got {config.warmup}")
    if not config.micro_batches or not tps:
        raise InputError("--micro-batch and --tp each need at least one value")


def _check_dtype(config: BenchConfig, kind: str) -> None:
    if config.dtype not in DTYPES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    if config.attention not in PLAN_BACKENDS:
        raise InputError(f"--attention must be one of {', '.join(PLAN_BACKENDS)}, got {config.attention!r}")
    if kind == "cpu" and config.dtype == "tf32":
        raise InputError("--dtype tf32 needs a GPU: TF32 is a CUDA matmul mode (use fp32 on CPU)")
    if config.attention == "flash":
        if kind != "cuda" or not flash_attn_available():
            raise InputError("--attention flash needs a CUDA GPU and the flash_attn package")
        if config.dtype not in ("bf16", "fp16"):
            raise InputError(f"--attention flash runs in bf16/fp16, not {config.dtype}")
        if torch.cuda.get_device_capability(0) < (8, 0):
            raise InputError("--attention flash needs compute capability 8.0 or newer")


# --------------------------------------------------------------------------------------------- measuring (rank)


def _align(tp: TPContext, device: torch.device) -> None:
    """Start a timed region together on every rank of the group (the times then include waiting in
    collectives for slower ranks, as in training, but not the skew of the previous region)."""
    synchronize(device)
    if tp.size > 1:
        dist.barrier(group=tp.group)


def _init_weights(module: StageModule, seed: int) -> None:
    """normal(0, 0.02) for every weight but the norms (ones), drawn locally on CPU (values do not set cost)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0.0, INIT_STD, generator=generator)


def _build_parts(config: BenchConfig, tp: TPContext, device: torch.device) -> dict[str, StageModule]:
    """The three parts as StageModules on `device`: one layer, the embedding alone, the head alone (eager;
    `_compile_parts` compiles them when the resolved runtime paths compile)."""
    backend = PLAN_BACKENDS[config.attention]
    paths = config.runtime.resolved(device.type == "cuda")
    layouts = {"layer": ((0, 1), False, False), "embedding": ((0, 0), True, False), "head": ((0, 0), False, True)}
    parts: dict[str, StageModule] = {}
    for name, (layers, first, last) in layouts.items():
        module = StageModule(config.spec, layers, first, last, tp, backend, recompute=config.recompute,
                             chunked_loss=paths.chunked_loss, loss_kernel=paths.loss_kernel)
        _init_weights(module, seed=1000 * tp.rank + len(parts))
        parts[name] = module.to(device)
    return parts


def _compile_parts(parts: dict[str, StageModule], config: BenchConfig, tp: TPContext,
                   device: torch.device) -> bool:
    """Compile the parts and warm them up at the first micro-batch size (collectives muted); when compiling failed
    on any rank of the group every part runs eager, with one warning line. True when the parts stay compiled."""
    scope = stage_compile_scope(config.runtime.compile_scope, tp.size, 1)  # what a run's stage of this TP takes
    return compile_or_fall_back(list(parts.values()), config.micro_batches[0], config.seq_len, device,
                                lambda: autocast(device, config.dtype), tp.rank,
                                all_reduce_max(tp.group if tp.size > 1 else None), fallback_text="measuring eager",
                                scope=scope)


def _inputs(part: str, spec: ModelSpec, b: int, s: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The arguments of a part's forward: the same values on every rank (a replicated input, as in a run).
    layer: hidden fp32 [b, s, hidden] (needs a gradient); embedding: tokens int64 [b, s]; head: hidden and
    targets int64 [b, s]."""
    generator = torch.Generator(device="cpu").manual_seed(b * 7919 + s)
    hidden = torch.randn(b, s, spec.hidden_size, generator=generator).to(device).requires_grad_()
    tokens = torch.randint(0, spec.vocab_size, (b, s), generator=generator).to(device)
    if part == "layer":
        return (hidden,)
    if part == "embedding":
        return (tokens,)
    return hidden, tokens


def _time_part(forward: Callable[[], torch.Tensor], tp: TPContext, device: torch.device,
               warmup: int, repeats: int) -> tuple[float, float]:
    """(median forward seconds, median backward seconds) over `repeats` after `warmup` untimed runs; the
    backward gets a gradient of ones shaped like the output ([b, s, hidden], or a scalar for the head).

    On CPU the time a run spent runnable but waiting for its core (another process on it: Linux schedstat)
    is left out, as the runtime's emulated slowdown leaves it out (runtime/device/slowdown.py): a device's time is
    its on-core compute plus its blocking communication, whatever else the host runs. The kernel books run-queue
    delay when the thread gets its core back, so on a busy host the booked delay of a short run can exceed its
    elapsed time: a sample is never taken below the CPU time this thread spent in it (forward on the calling
    thread; backward's autograd threads are not counted, so there the bound is weaker but still >= 0)."""
    fwd: list[float] = []
    bwd: list[float] = []
    queued = runqueue_seconds if device.type == "cpu" else (lambda: 0.0)

    def on_core(start: float, waited: float, cpu: float) -> float:
        elapsed = time.perf_counter() - start
        return max(elapsed - (queued() - waited), time.thread_time() - cpu, 0.0)

    for i in range(warmup + repeats):
        _align(tp, device)
        start, waited, cpu = time.perf_counter(), queued(), time.thread_time()
        out = forward()
        synchronize(device)
        fwd_s = on_core(start, waited, cpu)
        grad = torch.ones_like(out)
        _align(tp, device)
        start, waited, cpu = time.perf_counter(), queued(), time.thread_time()
        out.backward(grad)
        synchronize(device)
        bwd_s = on_core(start, waited, cpu)
        del out, grad
        if i >= warmup:
            fwd.append(fwd_s)
            bwd.append(bwd_s)
    return statistics.median(fwd), statistics.median(bwd)


def _note_storage(tensor: torch.Tensor, found: dict[int, int]) -> None:
    """Record a tensor's storage (address -> bytes) in `found`; views share one entry."""
    storage = tensor.untyped_storage()
    if storage.nbytes() > 0:
        found[storage.data_ptr()] = storage.nbytes()


def _forward_saving(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, dict[int, int]]:
    """Run `forward` and return its output and the storages it saved for the backward plus the output's."""
    found: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        _note_storage(tensor, found)
        return tensor.detach()  # the same storage, kept alive; no grad_fn, so an output saved by its own node
        # makes no reference cycle (which would outlive the measurement, and the process group with it)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward()
    _note_storage(out, found)
    return out, found


def saved_activation_bytes(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes a forward newly allocates and keeps until its backward (saved tensors and output, distinct
    storages). Storages saved by a first forward whose graph stays alive are pre-existing (weights, input,
    cached tables) and are left out of the second forward's count. Works on any device."""
    first, before = _forward_saving(forward)
    second, found = _forward_saving(forward)
    total = sum(nbytes for address, nbytes in found.items() if address not in before)
    del first, second
    return total


def cuda_activation_bytes(forward: Callable[[], torch.Tensor], device: torch.device) -> int:
    """torch.cuda.memory_allocated after a forward (output kept) minus before it, in bytes."""
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    out = forward()
    synchronize(device)
    used = torch.cuda.memory_allocated(device) - before
    del out
    return max(used, 0)


def _fixed_bytes(device: torch.device, parts: dict[str, StageModule]) -> float | None:
    """CUDA: bytes that stay allocated beside the parts' parameters once a micro-batch's measurements are over
    (cuBLAS workspaces, rotary tables, communication scratch): the caching allocator's allocated bytes less the
    parameters, never its reserved-but-unused cache. CPU: None (not measured)."""
    if device.type != "cuda":
        return None
    params = sum(p.numel() * p.element_size() for module in parts.values() for p in module.parameters())
    return float(max(torch.cuda.memory_allocated(device) - params, 0))


def _measure_part(module: StageModule, part: str, config: BenchConfig, b: int, tp: TPContext,
                  device: torch.device) -> PartTimes:
    """Times and activation bytes of one part at micro-batch size `b`."""
    args = _inputs(part, config.spec, b, config.seq_len, device)

    def forward() -> torch.Tensor:
        with autocast(device, config.dtype):
            return module(*args)

    fwd_s, bwd_s = _time_part(forward, tp, device, config.warmup, config.repeats)
    if device.type == "cuda":
        nbytes = cuda_activation_bytes(forward, device)
    else:
        nbytes = saved_activation_bytes(forward)
    for param in module.parameters():
        param.grad = None
    return PartTimes(fwd_s, bwd_s, float(nbytes))


def _is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM, Python MemoryError, or the CPU allocator's failure (a RuntimeError)."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _any_rank(flag: bool, tp: TPContext, device: torch.device) -> bool:
    """True when `flag` holds on some rank of the group (collective)."""
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    tp.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def _max_over_ranks(parts: dict[str, PartTimes], fixed: float | None, tp: TPContext,
                    device: torch.device) -> tuple[dict[str, PartTimes], float | None]:
    """Element-wise max over the group of every figure (collective); the group's slowest rank sets the pace."""
    values = [v for name in PARTS for v in (parts[name].fwd_s, parts[name].bwd_s, parts[name].activation_bytes)]
    values.append(-1.0 if fixed is None else fixed)
    packed = torch.tensor(values, dtype=torch.float64, device=device)
    tp.all_reduce(packed, op=dist.ReduceOp.MAX)
    flat = packed.tolist()
    merged = {name: PartTimes(*flat[3 * i:3 * i + 3]) for i, name in enumerate(PARTS)}
    return merged, (None if flat[-1] < 0 else flat[-1])


def _measure_entry(parts: dict[str, StageModule], config: BenchConfig, b: int, tp: TPContext,
                   device: torch.device) -> EntryResult | Skipped:
    """One micro-batch size on this rank; every rank agrees on a skip (out of memory anywhere)."""
    measured: dict[str, PartTimes] = {}
    reason = ""
    try:
        for name in PARTS:
            measured[name] = _measure_part(parts[name], name, config, b, tp, device)
    except Exception as exc:  # only out-of-memory is survivable
        if not _is_out_of_memory(exc):
            raise
        reason = "out of memory"
        for module in parts.values():
            module.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if _any_rank(bool(reason), tp, device):
        return Skipped(b, tp.size, reason or "out of memory on another rank")
    merged, fixed = _max_over_ranks(measured, _fixed_bytes(device, parts), tp, device)
    return EntryResult(b, tp.size, merged, fixed)


def _rank_device(rank: int, kind: str, dtype: str) -> torch.device:
    """Claim this rank's device: a pinned core (CPU) or GPU `rank` with the dtype's matmul setting."""
    if kind != "cuda":
        pin_emulated_device(rank)
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    use_tf32_matmuls(device, dtype)
    return device


def _measure_rank(rank: int, tp_size: int, config: BenchConfig, device: torch.device,
                  results: queue_module.Queue) -> None:
    """Build the parts and measure every micro-batch size; rank 0 puts the group's results."""
    tp = TPContext(dist.group.WORLD if tp_size > 1 else None, tp_size, rank)
    parts = _build_parts(config, tp, device)
    dtype = autocast_dtype(config.dtype)
    # cast_once: the layer multiplies by working copies made once (per step in a run: outside the timed parts)
    working = WorkingWeights(parts["layer"], dtype) if config.runtime.cast_once and dtype is not None else None
    with working.cast() if working is not None else nullcontext():
        if config.runtime.resolved(device.type == "cuda").compile and _compile_parts(parts, config, tp, device):
            config = replace(config, warmup=max(1, config.warmup))  # each new shape compiles in its first run
        for b in config.micro_batches:
            result = _measure_entry(parts, config, b, tp, device)
            if rank == 0:
                results.put(result)


def _worker(rank: int, tp_size: int, port: int, config: BenchConfig, kind: str,
            results: queue_module.Queue) -> None:
    """One spawned rank of a TP group (see `_measure_rank`).

    Collectives issued under the saved-tensor hooks keep those Python hooks in their work objects, which gloo
    frees on its own threads: the process group must go (joining those threads) while Python still runs, so
    every reference to it is dropped, and cycles collected, before it is destroyed."""
    device = _rank_device(rank, kind, config.dtype)
    if tp_size > 1:
        dist.init_process_group("nccl" if kind == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=tp_size, timeout=timedelta(seconds=config.timeout_s),
                                **({"device_id": device} if kind == "cuda" else {}))
    try:
        _measure_rank(rank, tp_size, config, device, results)
    finally:
        gc.collect()
        if tp_size > 1:
            dist.barrier()  # no rank tears its connections down while another still uses them
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver (parent)


def _drain(results: queue_module.Queue, on_result: Callable[[EntryResult | Skipped], None]) -> None:
    while True:
        try:
            item = results.get_nowait()
        except queue_module.Empty:
            return
        on_result(item)


def measure_tp(config: BenchConfig, tp: int, kind: str,
               on_result: Callable[[EntryResult | Skipped], None]) -> None:
    """Spawn the `tp` ranks of one TP group and pass each micro-batch's result to `on_result` as it comes."""
    import torch.multiprocessing as mp

    from ..hardware.probe_gloo import free_port, own_process_group_env

    results = mp.get_context("spawn").Queue()
    try:
        with own_process_group_env():
            context = mp.start_processes(_worker, args=(tp, free_port(), config, kind, results), nprocs=tp,
                                         join=False, start_method="spawn")
        while not context.join(timeout=0.2):
            _drain(results, on_result)
    except Exception as exc:  # ProcessRaisedException, ProcessExitedException
        lines = str(exc).strip().splitlines()
        raise RuntimeFailure(f"layer measurement at tp {tp} failed: {lines[-1] if lines else type(exc).__name__}"
                             ) from None
    _drain(results, on_result)


def _progress(enabled: bool, total: int):  # noqa: ANN202 - a rich Progress (disabled when not asked)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled)
    return bar, bar.add_task("measuring layers", total=total)


def measure(config: BenchConfig, tps: tuple[int, ...], kind: str, progress: bool = False,
            on_skip: Callable[[Skipped], None] | None = None) -> tuple[list[EntryResult], list[Skipped]]:
    """Measure every (micro_batch_size, tp), tp by tp; returns (entries, skipped), skipped ones also
    reported to `on_skip` as they happen. A rich progress bar on stderr when `progress`."""
    entries: list[EntryResult] = []
    skipped: list[Skipped] = []
    bar, task = _progress(progress, len(tps) * len(config.micro_batches))

    def take(item: EntryResult | Skipped) -> None:
        if isinstance(item, Skipped):
            skipped.append(item)
            if on_skip is not None:
                on_skip(item)
        else:
            entries.append(item)
        bar.advance(task)

    with bar:
        for tp in tps:
            bar.update(task, description=f"measuring layers at tp {tp}")
            measure_tp(config, tp, kind, take)
    return entries, skipped


def _sig(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits: timings are not more precise, and files diff cleanly."""
    return float(f"{value:.{digits}g}")


def _part_cost(times: PartTimes) -> PartCost:
    return PartCost(fwd_s=_sig(times.fwd_s), bwd_s=_sig(times.bwd_s), activation_bytes=times.activation_bytes)


def build_profile(config: BenchConfig, entries: list[EntryResult], device_type: str, source: str) -> LayerProfile:
    """A `flashflex.layers/1` profile of the measured entries, sorted by (tp, micro_batch_size)."""
    rows = [ProfileEntry(micro_batch_size=e.micro_batch_size, tp=e.tp, layer=_part_cost(e.parts["layer"]),
                         embedding=_part_cost(e.parts["embedding"]), head=_part_cost(e.parts["head"]),
                         fixed_bytes=None if e.fixed_bytes is None else _sig(e.fixed_bytes))
            for e in sorted(entries, key=lambda e: (e.tp, e.micro_batch_size))]
    kind, _ = devices_available()
    paths = config.runtime.resolved(kind == "cuda")
    return LayerProfile(device_type=device_type, model=ModelShape.of(config.spec), seq_len=config.seq_len,
                        dtype=config.dtype, attention=config.attention,  # type: ignore[arg-type]
                        recompute=config.recompute, source=source, entries=rows,
                        runtime=ProfilePaths(compile=bool(paths.compile), chunked_loss=paths.chunked_loss,
                                             compile_scope=stage_compile_scope(paths.compile_scope, 1, 1)
                                             if paths.compile else None,
                                             cast_once=paths.cast_once, loss_kernel=paths.loss_kernel))

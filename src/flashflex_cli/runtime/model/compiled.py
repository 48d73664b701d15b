"""torch.compile for a pipeline stage, per block or whole (RuntimeOptions.compile, on by default on CUDA devices;
RuntimeOptions.compile_scope, semantics/runtime_paths.stage_compile_scope says which and why).

What is compiled (`compile_stage`), each as its own torch.compile'd callable in `StageModule.runners`, the
modules themselves untouched (parameter names, checkpoints and hooks unchanged):
- each decoder layer, with static shapes. Every layer of a stage is the same code over other parameters, and
  torch.compile lifts a module's parameters into graph inputs, so all layers share one compiled graph (one for
  the forward, one for the backward): compile time does not grow with depth, and stages holding any layer
  range compile the same block (torchtitan compiles Llama per block for the same reason). At TP 1 a layer is one
  graph, the norms, rotary embedding, SwiGLU and residual adds fused around the matrix products. At TP > 1 the
  layer's collectives (`copy_to_tp`, `reduce_from_tp`) are kept out of the graph (`TPContext.
  keep_collectives_eager`): each is a graph break, so a layer runs as the compiled pieces between its
  all-reduces (still shared by all layers); tracing a gloo or NCCL all-reduce into the graph would need
  functional collectives and would lose the collectives' timing.
- the last stage's final RMSNorm, and the chunked loss's per-chunk functions (runtime/model/chunked_loss.py, which
  says how they split around the vocabulary-parallel all-reduces). The unchunked loss (`chunked_loss` off)
  stays eager: it is kept as the recorded runs' path, for comparison.
- not the embedding: a lookup (plus, at TP > 1, a masked lookup and an all-reduce) has nothing to fuse.
- or, compile scope "stage": the stage's whole forward, `StageModule.run_parts` (embedding, layers, final norm,
  loss), one torch.compile'd function in `StageRunners.whole`; the chunked loss's autograd Function and its loop
  break the graph where dynamo cannot trace them, and run their compiled chunk functions there. At TP > 1 the
  layers' collectives are functional all-reduces traced into the graph (`TPContext.trace_collectives`: no graph
  break at them, so inductor sees, and may reorder, across them; they are not timed as TP communication then),
  and the warm-up runs them for real on every rank of the group (all of them compile the same graph, so a
  compiler failure stops each before its first collective); the vocabulary-parallel loss's all-reduces stay the
  in-place ones. Its compile time grows with the stage's depth (STAGE_GRAPH_MAX_LAYERS bounds what "auto" compiles
  whole).

`warm_up` runs the compiled stage once on dummy inputs of the real shapes (forward and backward, under the run's
autocast, recompute as configured), with the TP collectives muted, so the compilation happens before step 0 and
outside every step's time; gradients are dropped. `compile_or_fall_back` is the one place that compiles a
group of ranks' stages: compile, warm up, agree with the other ranks (a compilation error anywhere means every
rank runs eager, `eager_stage`), one warning line from the highest failing rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ...hardware.device_sync import synchronize
from .attention import LOG
from .chunked_loss import EAGER_KERNELS, compile_kernels
from .stage import StageModule, StageRunners

CompileBackend = str | Callable[..., Any]


def compile_stage(module: StageModule, backend: CompileBackend = "inductor", scope: str = "block") -> None:
    """Run `module`'s layers, final norm and chunked loss compiled (module docstring), per block, or with
    `scope` "stage" its whole forward as one compiled function (the loss's chunk functions compiled inside it where
    it breaks its graph; at TP > 1 the layers' collectives traced). The compilation itself happens at the first
    call (`warm_up`)."""
    if module.tp.size > 1:
        if scope == "stage":
            module.tp.trace_collectives()
        else:
            module.tp.keep_collectives_eager()

    def compiled(part: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return torch.compile(part, backend=backend, dynamic=False)

    loss = compile_kernels(backend) if module.last else EAGER_KERNELS
    if scope == "stage":
        module.runners = StageRunners(layers=tuple(module.layers), norm=module.norm if module.last else None,
                                      loss=loss, whole=compiled(module.run_parts))
        return
    norm = module.runners.norm
    module.runners = StageRunners(layers=tuple(compiled(layer) for layer in module.layers),
                                  norm=compiled(norm) if norm is not None else None, loss=loss)


def eager_stage(module: StageModule) -> None:
    """Run `module` uncompiled again (what `StageModule` builds), its TP collectives the timed in-place ones."""
    module.runners = StageRunners(tuple(module.layers), module.norm if module.last else None, EAGER_KERNELS)
    module.tp.plain_collectives()


def is_compiled(module: StageModule) -> bool:
    """True when the stage runs compiled parts."""
    return module.runners.whole is not None or module.runners.loss.compiled or \
        any(layer is not base for layer, base in zip(module.runners.layers, module.layers, strict=True)) or \
        (module.last and module.runners.norm is not module.norm)


@contextmanager
def _muted(module: StageModule) -> Iterator[None]:
    module.tp.muted = True
    try:
        yield
    finally:
        module.tp.muted = False


def dummy_inputs(module: StageModule, micro_batch: int, seq_len: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the stage's forward takes in training, with made-up values: tokens int64 [b, s] (first stage) or a
    hidden state fp32 [b, s, hidden] that needs a gradient; targets int64 [b, s] on the last stage (else None).
    Tokens and targets are views of one [b, s + 1] row as in training (RankEngine.train_step), strides included:
    a compiled graph is specialised on them."""
    shape = (micro_batch, seq_len)
    rows = torch.zeros((micro_batch, seq_len + 1), dtype=torch.int64, device=device)
    if module.first:
        x = rows[:, :-1]
    else:
        x = torch.randn((*shape, module.spec.hidden_size), device=device).requires_grad_(True)
    targets = rows[:, 1:] if module.last else None
    return x, targets


def describe_failure(exc: BaseException) -> str:
    """One line: the exception's type and first line, and those of the error it wraps (torch.compile's
    BackendCompilerFailed wraps the compiler's own), e.g. "BackendCompilerFailed: RuntimeError: no compiler"."""
    def line(e: BaseException) -> str:
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__

    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    return f"{type(exc).__name__}: {line(inner)}" if isinstance(inner, BaseException) else line(exc)


def warm_up(module: StageModule, micro_batch: int, seq_len: int, device: torch.device,
            autocast: Callable[[], AbstractContextManager[object]]) -> tuple[float, str | None]:
    """One forward and backward of the stage on dummy inputs of shape [micro_batch, seq_len], collectives muted,
    gradients dropped: (seconds, None), or (seconds, "ErrorType: first line") when compiling failed. Out of
    memory is raised, not reported: the run would not fit eager either."""
    start = time.perf_counter()
    error: str | None = None
    x, targets = dummy_inputs(module, micro_batch, seq_len, device)
    try:
        with _muted(module):
            with autocast():
                out = module(x, targets)
            out.backward(torch.ones_like(out))
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - any compiler failure means: run eager
        error = describe_failure(exc)
    finally:
        for param in module.parameters():
            param.grad = None
    synchronize(device)
    return time.perf_counter() - start, error


def compile_or_fall_back(modules: Sequence[StageModule], micro_batch: int, seq_len: int, device: torch.device,
                         autocast: Callable[[], AbstractContextManager[object]], rank: int,
                         agree_max: Callable[[torch.Tensor], None], backend: CompileBackend = "inductor",
                         fallback_text: str = "every rank runs eager", scope: str = "block") -> bool:
    """Compile `modules` and warm each up at [micro_batch, seq_len]; `agree_max` all-reduces a one-element
    tensor with MAX over the ranks that must agree. True when every rank stays compiled; otherwise every module
    runs eager again and the highest failing rank logs one warning line ending in `fallback_text`."""
    errors: list[str] = []
    for module in modules:
        compile_stage(module, backend, scope)
        _, error = warm_up(module, micro_batch, seq_len, device, autocast)
        if error:
            errors.append(error)
    failed = torch.tensor([float(rank + 1 if errors else 0)], device=device)
    agree_max(failed)
    worst = int(failed.item()) - 1
    if worst < 0:
        return True
    for module in modules:
        eager_stage(module)
    if worst == rank:
        LOG.warning("flashflex: rank %d: torch.compile failed (%s); %s", rank, errors[0], fallback_text)
    return False


def all_reduce_max(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], None]:
    """`agree_max` over `group` (None: a single rank, nothing to agree with)."""
    def agree(tensor: torch.Tensor) -> None:
        if group is not None:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return agree

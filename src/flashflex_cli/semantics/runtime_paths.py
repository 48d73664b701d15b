"""Which code paths the runtime takes, as one torch-free record both the runtime and the cost model read.

The runtime runs with a `RuntimeOptions` (its switches, `flashflex launch --no-...`, saved in the run configuration
RUN/config.json: run_config.py), resolves it for its device (`resolved`), and writes the resolved record to
`RUN/runtime.json`. The cost model charges a run by the same record (`from_record`), so a run recorded before a
path existed is charged by the behaviour it really had: a key absent from an older record means the path that
existed then (`LEGACY`).

Paths:
- lean_p2p, overlap_dp, hierarchical_dp: the communication paths (runtime/parallel/pipeline.py, runtime/parallel/grad_sync.py).
- compile: each decoder layer compiled with torch.compile (default: on CUDA devices only).
- compile_scope (with compile): "block", each decoder layer its own graph (shared by all layers), the final norm and
  the loss's chunks apart; "stage", the whole stage's forward (embedding, layers, final norm, loss) one graph (at
  TP > 1 its all-reduces traced as functional collectives); "auto", `stage_compile_scope`'s rule.
  The record holds rank 0's resolved choice.
- chunked_loss: the output projection and cross-entropy computed in chunks of tokens (`loss_chunk_tokens`), so no
  [tokens, vocab] fp32 logits are ever held; False: the whole logits tensor, upcast to fp32 for the loss.
- loss_kernel (with chunked_loss): "own", the project's chunked loss (runtime/model/chunked_loss.py), or "torch",
  torch's `linear_cross_entropy` on stages of TP 1 where the installed torch has it (runtime/model/torch_loss.py
  says why it is not the default); the cost model charges both as the project's.
- cast_once: under autocast, the decoder layers' matmul weights cast to the compute dtype once per step and
  shared by every micro-batch (runtime/model/working_weights.py); False: autocast casts them in each
  micro-batch's forward, and every micro-batch in flight keeps its own copy. No effect in fp32 plans. Off by
  default until the cost model's count of it is exact per micro-batch in flight (tests/test_memory_tracked.py
  holds its peaks within 2%, not yet its per-micro-batch change within 0.5%).
- optimizer: "fused" (torch.optim.AdamW(fused=True), one kernel) or "foreach" (multi-tensor kernels, several
  passes and a temporary as large as the parameters); "auto": fused on CUDA, foreach on CPU.
- compute_dtype: the dtype matmuls run in: the plan's bf16/fp16 under autocast on every device, fp32 for fp32
  plans (tf32: fp32 tensors; on CUDA with TF32 matmuls).
- loss_scaling (fp16 runs only, written beside these by the worker): the dynamic loss scaling's settings
  (run_config.LossScaling, applied by runtime/training/loss_scale.py: init_scale, growth_factor, backoff_factor, growth_interval); absent: no loss scaling
  (bf16 and fp32 runs, and fp16 runs recorded before it existed). It changes no time or memory the cost model
  charges, so `from_record` does not read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, get_args

from pydantic import ConfigDict, StrictBool
from pydantic.dataclasses import dataclass as settings_dataclass

from ..fileio import refused_in_one_line

OptimizerPath = Literal["auto", "fused", "foreach"]
OPTIMIZER_PATHS: tuple[str, ...] = get_args(OptimizerPath)
LossKernel = Literal["own", "torch"]
CompileScope = Literal["block", "stage", "auto"]
COMPILE_SCOPES: tuple[str, ...] = get_args(CompileScope)
# "auto" compiles a stage whole up to this many layers: its compile time grows with depth (one graph), where per
# block it does not.
STAGE_GRAPH_MAX_LAYERS = 32


def stage_compile_scope(setting: str, tp: int, num_layers: int) -> str:
    """The compile scope a stage of `num_layers` layers at TP degree `tp` runs under RuntimeOptions.compile_scope
    `setting`: "stage" and "block" as set; "auto": "stage" at TP 1 up to STAGE_GRAPH_MAX_LAYERS layers, else
    "block".

    Why "stage" for "auto" at TP 1: one graph lets inductor fuse across the layers' boundaries (each residual add
    with the next layer's RMSNorm) and the final norm with the loss's first pass, and runs one compiled call per
    micro-batch instead of one per layer; issue 31 records the project's Llama 1B compiled whole at 544 ms a step
    on an H100 against 605 ms per block on the faster-memory H200 (seq 2048, 16 sequences a step).
    benchmarks/bench_gpu_runtime.py --ablations measures both scopes on one GPU (rows "compile scope block" and
    "compile scope stage"), with each one's compile seconds. Why "block" for "auto" at TP > 1: there a whole-stage
    graph traces the layers' all-reduces as functional collectives (runtime/model/compiled.py), which no run has
    measured against per block yet (one GPU holds no TP group); per block keeps their timing and a compile time
    that does not grow with depth. `--compile-scope stage` compiles a TP > 1 stage whole."""
    if setting == "block":
        return "block"
    if setting == "stage":
        return "stage"
    return "stage" if tp == 1 and num_layers <= STAGE_GRAPH_MAX_LAYERS else "block"

LOSS_KERNELS: tuple[str, ...] = get_args(LossKernel)

# Bytes of fp32 logits one chunk of the chunked loss may hold ([chunk tokens, vocab / tp] x 4 bytes).
LOSS_CHUNK_BYTES = 256 * 2**20


def loss_chunk_tokens(vocab_per_device: int) -> int:
    """Tokens per chunk of the chunked loss on a device holding `vocab_per_device` vocabulary rows: as many as
    keep one chunk's fp32 logits within LOSS_CHUNK_BYTES (at least 1)."""
    return max(1, LOSS_CHUNK_BYTES // (4 * max(1, vocab_per_device)))


def compute_dtype(plan_dtype: str) -> str:
    """The dtype the runtime's matmuls run in for a plan trained in `plan_dtype` ("bf16", "fp16", "fp32",
    "tf32"): bf16 and fp16 under autocast over fp32 weights, fp32 otherwise (tf32 keeps fp32 tensors)."""
    return plan_dtype if plan_dtype in ("bf16", "fp16") else "fp32"


def _refused(field: str, problem: str) -> ValueError:
    return ValueError(f"{field} {problem}")


@refused_in_one_line(_refused)
@settings_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class RuntimeOptions:
    """The runtime's switches (module docstring). `compile` None and `optimizer` "auto" are resolved per device
    by `resolved`; every other field is already concrete. A pydantic dataclass, part of the run configuration
    (run_config.py): each value is checked (JSON types, no conversion) when built, loaded or replaced; built in
    code, a bad value is a ValueError in one line ("optimizer must be one of auto, fused, foreach, got 'adam'")."""

    lean_p2p: StrictBool = True
    overlap_dp: StrictBool = True
    hierarchical_dp: StrictBool = True
    compile: StrictBool | None = None
    chunked_loss: StrictBool = True
    optimizer: OptimizerPath = "auto"
    loss_kernel: LossKernel = "own"
    cast_once: StrictBool = False
    compile_scope: CompileScope = "auto"

    def resolved(self, on_cuda: bool) -> RuntimeOptions:
        """These options with the device-dependent defaults decided for a CUDA (`on_cuda`) or CPU device."""
        return replace(self, compile=on_cuda if self.compile is None else self.compile,
                       optimizer=("fused" if on_cuda else "foreach") if self.optimizer == "auto" else self.optimizer)

    def to_record(self, plan_dtype: str) -> dict[str, Any]:
        """The runtime.json object of a resolved run (keys sorted by the writer)."""
        return {**asdict(self), "compute_dtype": compute_dtype(plan_dtype)}


# The command-line flags of each switch (`flashflex plan/show/launch`): (on, off); the optimizer takes a value.
SWITCH_FLAGS: dict[str, tuple[str, str]] = {
    "lean_p2p": ("--lean-p2p", "--no-lean-p2p"), "overlap_dp": ("--overlap-dp", "--no-overlap-dp"),
    "hierarchical_dp": ("--hierarchical-dp", "--no-hierarchical-dp"), "compile": ("--compile", "--no-compile"),
    "chunked_loss": ("--chunked-loss", "--no-chunked-loss"), "cast_once": ("--cast-once", "--no-cast-once"),
}
OPTIMIZER_FLAG = "--optimizer"
# The switches that take a value, by RuntimeOptions field: their flag and the values it accepts.
VALUE_FLAGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "optimizer": (OPTIMIZER_FLAG, OPTIMIZER_PATHS), "loss_kernel": ("--loss-kernel", LOSS_KERNELS),
    "compile_scope": ("--compile-scope", COMPILE_SCOPES),
}


def switch_flag(name: str, value: Any) -> str:
    """The flag that sets switch `name` to `value`: "--no-compile", "--optimizer foreach"."""
    if name in VALUE_FLAGS:
        return f"{VALUE_FLAGS[name][0]} {value}"
    return SWITCH_FLAGS[name][0 if value else 1]


def non_default_flags(options: RuntimeOptions) -> list[str]:
    """The flags that give `options` from the launch defaults, in field order (empty for the defaults)."""
    default = RuntimeOptions()
    return [switch_flag(f.name, getattr(options, f.name)) for f in fields(RuntimeOptions)
            if getattr(options, f.name) != getattr(default, f.name)]


# What a run did where its runtime.json lacks a key: the paths that existed before the key was recorded.
LEGACY: dict[str, Any] = {"lean_p2p": True, "overlap_dp": True, "hierarchical_dp": True, "compile": False,
                          "chunked_loss": False, "optimizer": "foreach", "loss_kernel": "own",
                          "cast_once": False, "compile_scope": "block"}


@dataclass(frozen=True)
class RecordedPaths:
    """A run's paths as its runtime.json says (legacy values for absent keys), and its compute dtype."""

    options: RuntimeOptions
    compute_dtype: str


def from_record(record: dict[str, Any], plan_dtype: str, on_cuda: bool) -> RecordedPaths:
    """The paths of a recorded run from its runtime.json object `record`; a key it lacks takes the behaviour of
    the runtime before that key was recorded (`LEGACY`; the compute dtype: the plan's on CUDA, fp32 on CPU)."""
    values = {f.name: record.get(f.name, LEGACY[f.name]) for f in fields(RuntimeOptions)}
    for name in ("lean_p2p", "overlap_dp", "hierarchical_dp", "compile", "chunked_loss", "cast_once"):
        if not isinstance(values[name], bool):
            raise ValueError(f"{name} must be true or false, got {values[name]!r}")
    if values["optimizer"] not in ("fused", "foreach"):
        raise ValueError(f"optimizer must be fused or foreach, got {values['optimizer']!r}")
    if values["compile_scope"] not in COMPILE_SCOPES:
        raise ValueError(f"compile_scope must be block, stage or auto, got {values['compile_scope']!r}")
    if values["loss_kernel"] not in LOSS_KERNELS:
        raise ValueError(f"loss_kernel must be own or torch, got {values['loss_kernel']!r}")
    legacy_dtype = compute_dtype(plan_dtype) if on_cuda else "fp32"
    dtype = record.get("compute_dtype", legacy_dtype)
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"compute_dtype must be bf16, fp16 or fp32, got {dtype!r}")
    return RecordedPaths(RuntimeOptions(**values), dtype)

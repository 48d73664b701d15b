"""RankEngine: one rank's share of training under any asymmetric plan.

API (stable; later versions only add optional keyword arguments)::

    groups = build_groups(plan, rank)                 # runtime/parallel/groups.py, collective, after init_process_group
    engine = RankEngine(plan, rank, groups, device, optim: OptimConfig, seed=0, slowdown=1.0,
                        options=RuntimeOptions(),         # the runtime's paths (semantics/runtime_paths.py)
                        loss_scaling=LossScaling())       # fp16 plans: dynamic loss scaling (runtime/training/loss_scale.py)
    result = engine.train_step(tokens)                # -> StepResult
    engine.pipeline_slice(global_batch) -> slice      # rows of the global batch this rank's pipeline takes
    engine.shard_specs() -> list[ShardSpec]           # global name, full shape, (dim, start, stop), owner
    engine.state_for_checkpoint() -> dict[str, Tensor]
    engine.wait_for_parameters()                      # sharded optimizer: land the update's gathers in flight
    engine.checkpoint_shards() -> dict[str, ShardSpec]  # where each key of state_for_checkpoint sits (for dcp.save)
    engine.load_local(fill)                           # resume in place, only this rank's slices (any plan)
    engine.load_from_full(get_full)                   # resume from full tensors (any plan)
    engine.gather_full_state() -> dict[str, Tensor]   # full tensors of this rank's state keys (TP collective)
    engine.gather_full_grads() / gather_full_params() # test helpers, collective over the TP group
    engine.step                                       # steps taken (batches consumed, skipped ones included)
    engine.optimizer_steps                            # AdamW updates taken (fp16: steps not skipped)
    engine.scaler                                     # fp16: the job's loss scaler (runtime/training/loss_scale.py), else None
    engine.options                                    # the paths that run (resolved; compile off after a fallback)
    engine.compile_seconds                            # the compile warm-up before step 0 (None: not compiled)

`tokens`: int64 [n_seq, seq_len + 1], this pipeline's rows of the global batch (n_seq = micro_batch_size *
num_micro_batches of the pipeline); inputs are tokens[:, :-1], targets tokens[:, 1:]. Every rank of the pipeline
passes the same tensor (only the first and last stages read it).

Loss semantics: the GLOBAL mean of per-token cross-entropy over all tokens of the global batch (the loss is
summed over tokens and divided by the global token count), so a plan's run equals one-device training on the
same global batch. `StepResult.loss` is that value, identical on every rank.

State keys: "<name>" (fp32 master parameter shard), "<name>.exp_avg", "<name>.exp_avg_sq" (AdamW moments, same
shard; with the plan's optimizer sharding, a sharded parameter's moments are this rank's pieces instead, keyed
"<name>.<moment>@DIM:START:STOP" and placed by `checkpoint_shards()`: runtime/parallel/sharded_optimizer.py), "step" (int64 scalar tensor: steps taken), "optimizer_steps" (int64: AdamW updates taken, fewer than
"step" by the steps fp16 loss scaling skipped) and, in fp16 plans, "loss_scale" (fp32) and
"loss_scale_growth_tracker" (int32). Global names are plan-independent (see runtime/model/stage.py). A checkpoint that
lacks the optional scalars loads with optimizer_steps = step and the initial loss scale.

Precision: fp32 parameters always; the compute runs under autocast in the plan's dtype on every device (bf16 or
fp16; semantics/runtime_paths.compute_dtype); fp32 and tf32 plans compute in fp32 (tf32: TF32 matmuls on CUDA).
fp16 plans scale the loss dynamically, one scale for the whole job (runtime/training/loss_scale.py): a step whose
gradients overflow anywhere is skipped on every rank (`StepResult.skipped`) and the scale backs off.

Compilation (options.compile): the stage's layers, final norm and chunked loss are compiled (runtime/model/compiled.py)
and warmed up in the constructor, on dummy inputs of the real shapes, so no step pays for it; if compiling fails
on any rank, every rank runs eager (one warning line, `options.compile` then False). The step itself never waits
for the device before its end: the loss and the gradient norm are read once, after the optimizer step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ...errors import InputError
from ...plan.schema import Plan
from ...semantics.optimizer_shards import ShardPiece, plan_pieces
from ...semantics.outer_sync import group_of_pipeline, group_pipelines, group_sequences
from ...semantics.parameters import ParamInfo, stage_params
from ...semantics.runtime_paths import RuntimeOptions, stage_compile_scope
from ..checkpoint.dcp import shards_for
from ..device.oom import PhaseTracker
from ..device.op_timer import OpTimer
from ..device.slowdown import Slowdown
from ..model.attention import EAGER, PLAN_BACKENDS, choose_backend
from ..model.compiled import CompileBackend, all_reduce_max, compile_or_fall_back
from ..model.init import shard_init
from ..model.precision import autocast, autocast_dtype, use_tf32_matmuls
from ..model.stage import StageModule
from ..model.working_weights import WorkingWeights
from ..parallel.grad_sync import GradSync
from ..parallel.groups import PlanGroups
from ..parallel.pipeline import PipelineRunner, PipelineTimes
from ..parallel.sharded_optimizer import ShardedGradSync
from ..parallel.shards import ShardSpec
from .loss_scale import SCALE_KEY, TRACKER_KEY, JobScaler, LossScaling, poison
from .optimizer import OptimConfig, lr_at, make_optimizer, restore_moments, set_lr

# the plan's attention setting -> the runtime's backend (flash-attn only where supported, else SDPA, logged)

__all__ = ["OptimConfig", "RankEngine", "ShardSpec", "StepResult", "plan_shard_specs"]

MOMENTS = ("exp_avg", "exp_avg_sq")
UPDATES_KEY = "optimizer_steps"


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: global mean loss (same on every rank), gradient norm before clipping, learning rate
    used, and timings in seconds ("forward", "backward", "p2p", "tp_comm" (CPU only), "dp_sync" (the exposed DP
    reduction: from the end of the schedule until the sums are back), "dp_total" (CPU only: seconds the DP
    collectives ran, overlapped or not), "optimizer", "step", "pipeline"). `ops`: this rank's compute ops (kind
    "F"/"B", micro-batch, start_s, end_s since the step start), when train_step was asked to record them.
    fp16 plans: `loss_scale`, the scale this step's loss was multiplied by, and `skipped`, whether the step was
    skipped on every rank for inf/NaN gradients (its update not applied; `grad_norm` then inf or NaN); None and
    False in other plans."""

    loss: float
    grad_norm: float
    lr: float
    timings: dict[str, float] = field(default_factory=dict)
    ops: tuple[tuple[str, int, float, float], ...] = ()
    loss_scale: float | None = None
    skipped: bool = False


def plan_shard_specs(plan: Plan, rank: int) -> list[ShardSpec]:
    """ShardSpecs of `rank`, computed from the plan alone (owner = lowest rank holding the same slice; in a plan
    of replica groups, of group 0: its inner optimizer state is the one a checkpoint keeps)."""
    spec = plan.inputs.model
    writers = set(group_pipelines(plan)[0])
    holders: dict[tuple[str, int | None, int, int], int] = {}
    mine: list[tuple[ParamInfo, tuple[str, int | None, int, int]]] = []
    for info_r in plan.ranks():
        pipe = plan.pipelines[info_r.pipeline]
        stage = pipe.stages[info_r.stage]
        for info in stage_params(spec, stage.layers, info_r.stage == 0, info_r.stage == len(pipe.stages) - 1):
            start, stop = info.bounds(stage.tp, info_r.tp_rank)
            key = (info.name, info.shard_dim, start, stop)
            if info_r.pipeline in writers:
                holders.setdefault(key, info_r.rank)
            if info_r.rank == rank:
                mine.append((info, key))
    return [ShardSpec(info.name, info.shape, key[1], key[2], key[3], holders.get(key) == rank) for info, key in mine]


class RankEngine:
    """Builds this rank's stage (initialised from `seed`, plan-independent, or by `initial(info, tp, tp_rank)`
    returning the local shard, e.g. from a Hugging Face checkpoint), its optimizer and its schedule.
    `compile_backend`: torch.compile's backend when `options` compile (tests pass a cheaper one).
    `loss_scaling`: the dynamic loss scaling of fp16 plans (ignored by others); `overflow_steps`: steps at which
    this rank's first gradient is made inf after the reduction (tests: runtime/training/loss_scale.py's injection)."""

    def __init__(self, plan: Plan, rank: int, groups: PlanGroups, device: torch.device, optim: OptimConfig,
                 seed: int = 0, slowdown: float = 1.0, attention: str | None = None,
                 initial: Callable[[ParamInfo, int, int], torch.Tensor] | None = None,
                 options: RuntimeOptions | None = None, phases: PhaseTracker | None = None,
                 compile_backend: CompileBackend = "inductor", loss_scaling: LossScaling | None = None,
                 overflow_steps: Collection[int] = ()) -> None:
        spec, train = plan.inputs.model, plan.inputs.train
        if not 0 <= rank < plan.world_size or groups.rank != rank:
            raise InputError(f"rank {rank} does not match the plan (world size {plan.world_size}) or its groups")
        self.plan, self.rank, self.groups, self.device, self.optim = plan, rank, groups, device, optim
        self.options = (options or RuntimeOptions()).resolved(device.type == "cuda")
        self.phases = phases or PhaseTracker()  # told the phase of each step (runtime/device/oom.py)
        me = plan.ranks()[rank]
        self.pipe = plan.pipelines[me.pipeline]
        self.stage_plan = self.pipe.stages[me.stage]
        first, last = me.stage == 0, me.stage == len(self.pipe.stages) - 1
        self.first, self.last = first, last
        layer_count = self.stage_plan.layers[1] - self.stage_plan.layers[0]
        scope = stage_compile_scope(self.options.compile_scope, self.stage_plan.tp, layer_count) \
            if self.options.compile else "block"  # this stage's resolved scope ("block": nothing compiled whole)
        self.options = replace(self.options, compile_scope=scope)
        self.amp_dtype = autocast_dtype(train.dtype)
        use_tf32_matmuls(device, train.dtype)
        wanted = attention or PLAN_BACKENDS[train.attention]
        self.backend = EAGER if wanted == EAGER else choose_backend(device, self.amp_dtype or torch.float32, rank,
                                                                   prefer=wanted)
        self.tp = groups.tp_context()
        self.module = StageModule(spec, self.stage_plan.layers, first, last, self.tp, self.backend,
                                  recompute=train.recompute, chunked_loss=self.options.chunked_loss,
                                  loss_kernel=self.options.loss_kernel)
        self.params: dict[str, tuple[ParamInfo, torch.nn.Parameter]] = {
            info.name: (info, param) for info, param in self.module.global_parameters()}
        with torch.no_grad():
            for info, param in self.params.values():
                if initial is not None:  # e.g. hf/load.py
                    param.copy_(initial(info, self.tp.size, self.tp.rank))
                else:  # drawn straight into the shard, bit-identical to full_init's tensor sliced (+ one block)
                    shard_init(spec, info.name, info.shape, seed, info.shard_dim,
                               *info.bounds(self.tp.size, self.tp.rank), out=param)
        self.module.to(device)
        pieces = plan_pieces(plan, groups.slices)  # [] unless the plan shards its optimizer state
        self.sync = ShardedGradSync(self.params, groups, pieces, overlap=self.options.overlap_dp,
                                    hierarchical=self.options.hierarchical_dp,
                                    num_micro=self.pipe.num_micro_batches) if pieces else \
            GradSync(self.params, groups, overlap=self.options.overlap_dp,
                     hierarchical=self.options.hierarchical_dp, num_micro=self.pipe.num_micro_batches)
        # options.cast_once under autocast: 16-bit working copies of the layers' weights, one per step
        self.working = WorkingWeights(self.module, self.amp_dtype) \
            if self.options.cast_once and self.amp_dtype is not None else None
        named = self.sync.optimizer_parameters() if isinstance(self.sync, ShardedGradSync) else \
            ((n, p) for n, (_, p) in self.params.items())
        self.optimizer = make_optimizer(named, optim, path=str(self.options.optimizer))
        self.scaler = JobScaler(loss_scaling or LossScaling(), device, self.optimizer, groups.world_group) \
            if self.amp_dtype == torch.float16 else None
        self.overflow_steps = frozenset(overflow_steps)
        self.slow = Slowdown(slowdown, comm_clock=lambda: self.tp.comm_seconds)
        self.runner = PipelineRunner(self.module, groups, len(self.pipe.stages), self.pipe.num_micro_batches,
                                     (self.pipe.micro_batch_size, train.seq_len, spec.hidden_size), device,
                                     autocast=self._autocast, slowdown=self.slow, lean=self.options.lean_p2p,
                                     transfer_dtype=self.amp_dtype or torch.float32, phases=self.phases)
        self.step = 0
        self.optimizer_steps = 0
        self._specs = plan_shard_specs(plan, rank)
        self.compile_seconds: float | None = None
        # A first collective with every rank on the world group, so later batched P2P on it may involve only a
        # subset of ranks (a requirement of NCCL's batch_isend_irecv).
        dist.all_reduce(torch.zeros(1, device=device), group=groups.world_group)
        if self.options.compile:
            self._compile(compile_backend)
        if isinstance(self.sync, ShardedGradSync):  # on what runs, compiled or not
            self._land_before_use(self.sync)

    def _compile(self, backend: CompileBackend) -> None:
        """Compile the stage and warm it up on dummy inputs (collective over the world group: every rank runs
        compiled, or, when one failed, every rank eager, with one warning line from the highest failing rank)."""
        start = time.perf_counter()
        with self._working_weights(1):  # compiled for the weights the steps multiply by
            compiled = compile_or_fall_back([self.module], self.pipe.micro_batch_size,
                                            self.plan.inputs.train.seq_len, self.device, self._autocast, self.rank,
                                            all_reduce_max(self.groups.world_group), backend,
                                            scope=self.options.compile_scope)
        for _, param in self.params.values():
            param.grad = None  # the warm-up's
        if compiled:
            self.compile_seconds = time.perf_counter() - start
        else:
            self.options = replace(self.options, compile=False, compile_scope="block")

    def _land_before_use(self, sync: ShardedGradSync) -> None:
        """Forward pre-hooks landing the parameters' gathers of the last update (`sync.gather_params`) part by
        part, before the first use: the embedding with the stage, each decoder layer, the final norm with the
        head (and a tied embedding on the last stage); all of them with the stage when it runs compiled whole.
        The hooks sit on what the stage calls (`runners`: a layer, or its compiled wrapper, whose hooks run
        outside the graph), never inside a graph. A no-op once the gathers are in."""
        name_of = {id(param): name for name, (_, param) in self.params.items()}
        runners = self.module.runners
        layers = [frozenset(name_of[id(param)] for param in layer.parameters()) for layer in self.module.layers]
        first = frozenset([name_of[id(self.module.embed)]]) if self.first else frozenset()
        self.module.register_forward_pre_hook(
            lambda *_: sync.wait_for_parameters(None if runners.whole is not None else first))
        if runners.whole is not None:
            return

        def part_hook(wanted: frozenset[str]) -> Callable[..., None]:
            return lambda *_: sync.wait_for_parameters(wanted)

        for runner, wanted in zip(runners.layers, layers, strict=True):
            assert isinstance(runner, torch.nn.Module)
            runner.register_forward_pre_hook(part_hook(wanted))
        if isinstance(runners.norm, torch.nn.Module):  # the last stage: norm, head, a tied embedding
            runners.norm.register_forward_pre_hook(part_hook(frozenset(self.params).difference(first, *layers)))

    def wait_for_parameters(self) -> None:
        """Land every parameter gather of the last update still in flight (sharded optimizer; else nothing):
        what reads the parameters between steps calls it first (checkpoints, exports, the end of training)."""
        if isinstance(self.sync, ShardedGradSync):
            self.sync.wait_for_parameters()

    def _working_weights(self, forwards: int) -> AbstractContextManager[object]:
        """The step's 16-bit working weights in place for `forwards` forwards, or the whole schedule under
        recompute (options.cast_once under autocast), else nothing."""
        if self.working is None:
            return nullcontext()
        self.wait_for_parameters()  # the cast reads every layer's weights at once
        return self.working.cast(None if self.plan.inputs.train.recompute else forwards)

    def _autocast(self) -> AbstractContextManager[object]:
        return autocast(self.device, self.plan.inputs.train.dtype)

    def pipeline_slice(self, global_batch: int) -> slice:
        """Rows of the global batch (int64 [global_batch, seq_len + 1]) this rank's pipeline takes."""
        if global_batch != self.plan.inputs.train.global_batch:
            raise InputError(f"global batch {global_batch} != plan global_batch {self.plan.inputs.train.global_batch}")
        start = sum(p.sequences for p in self.plan.pipelines[:self.groups.pipeline])
        return slice(start, start + self.pipe.sequences)

    def shard_specs(self) -> list[ShardSpec]:
        """One ShardSpec per local parameter, in the stage's parameter order."""
        return list(self._specs)

    def train_step(self, tokens: torch.Tensor, record_ops: bool = False) -> StepResult:
        """One optimizer step on this pipeline's rows `tokens` int64 [n_seq, seq_len + 1] (collective);
        `record_ops`: also return each compute op's start and end (StepResult.ops)."""
        train = self.plan.inputs.train
        want = (self.pipe.sequences, train.seq_len + 1)
        if tokens.dim() != 2 or tuple(tokens.shape) != want:
            raise InputError(f"tokens have shape {list(tokens.shape)}, this pipeline expects {list(want)}")
        timer = OpTimer(self.device)  # step stamps: CUDA events read once at the end, perf_counter on CPU
        t0, origin = timer.mark(), time.perf_counter()
        lr = lr_at(self.step, self.optim)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        self.tp.comm_seconds = 0.0
        tokens = tokens.to(self.device, non_blocking=True)
        mbs = self.pipe.micro_batch_size
        micro = [tokens[i * mbs:(i + 1) * mbs] for i in range(self.pipe.num_micro_batches)]
        inputs = [m[:, :-1] for m in micro]
        targets: list[torch.Tensor | None] = [m[:, 1:] for m in micro]
        # a plan of replica groups: the mean over this rank's group's tokens (semantics/outer_sync.py)
        global_tokens = group_sequences(self.plan, group_of_pipeline(self.plan, self.groups.pipeline)) * train.seq_len
        times = PipelineTimes(ops=[] if record_ops else None, origin=origin, origin_mark=t0)
        self.sync.start_step()  # overlap_dp: buckets start reducing inside the last backward
        with self._working_weights(self.pipe.num_micro_batches):  # one cast for every micro-batch
            loss_sum = self.runner.run(inputs, targets, 1.0 / global_tokens, times, timer=timer,
                                       scale_loss=self.scaler.scale if self.scaler is not None else None)
        t1 = timer.mark()
        self.sync.finish()  # overlap_dp: wait for this rank's buckets; else the blocking reduction
        t2 = timer.mark()
        self.phases.enter("optimizer")
        scaling: list[torch.Tensor] = []  # fp16: [found-inf flag, the scale this step used], read at the end
        if self.scaler is not None:
            if self.step in self.overflow_steps:
                poison(self.sync.local_grads() if isinstance(self.sync, ShardedGradSync)
                       else [p.grad for _, p in self.params.values() if p.grad is not None])
            scaling = [self.scaler.unscale_and_agree(), self.scaler.current()]  # clipping sees true gradients
        grad_norm = self.sync.clip(self.optim.grad_clip)  # a device scalar: read with the loss, at the end
        with self.slow.op():  # an emulated slow device updates its parameters as slowly as it computes
            if self.scaler is not None:
                self.scaler.step()  # skipped on every rank when any rank overflowed
                self.scaler.update()
            else:
                self.optimizer.step()
        if isinstance(self.sync, ShardedGradSync):
            self.sync.gather_params()  # posted, not waited: the next forward lands each part before its use
        t3 = timer.mark()
        if not (self.last and self.tp.rank == 0):
            loss_sum.zero_()
        dist.all_reduce(loss_sum, group=self.groups.world_group)
        self.step += 1
        t4 = timer.mark()
        timer.finish()
        times.resolve(timer)  # the schedule's ops and transfers, marked on the same timer
        # dp_sync: the EXPOSED reduction, from the end of the schedule until the sums are back
        timings = {"forward": times.forward, "backward": times.backward, "p2p": times.p2p,
                   "dp_sync": timer.seconds(t1, t2), "optimizer": timer.seconds(t2, t3),
                   "step": timer.seconds(t0, t4), "pipeline": timer.seconds(t0, t1)}
        if self.device.type == "cpu":
            timings["tp_comm"] = self.tp.comm_seconds
            timings["dp_total"] = self.sync.busy_s  # seconds the DP collectives ran, hidden or not
            timings["dp_across"] = self.sync.across_s  # of which hierarchical reductions' cross-node step
        read = torch.stack([loss_sum, grad_norm, *(t.double() for t in scaling)]).tolist()  # the step's one read
        loss, norm = read[0], read[1]
        if self.scaler is None:
            self.optimizer_steps += 1
            return StepResult(loss=loss / global_tokens, grad_norm=norm, lr=lr, timings=timings,
                              ops=tuple(times.ops or ()))
        skipped = read[2] > 0
        self.optimizer_steps += 0 if skipped else 1
        return StepResult(loss=loss / global_tokens, grad_norm=norm, lr=lr, timings=timings,
                          ops=tuple(times.ops or ()), loss_scale=read[3], skipped=skipped)

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """Local shards (detached views, do not modify): params, AdamW moments (zeros before the first step),
        "step", "optimizer_steps" and, with a loss scaler, its scale and growth tracker (module docstring)."""
        self.wait_for_parameters()
        out: dict[str, torch.Tensor] = {}
        sharded = self._sharded_names()
        for name, (_, param) in self.params.items():
            out[name] = param.detach()
            if name in sharded:
                continue
            state = self.optimizer.state.get(param, {})
            for moment in MOMENTS:
                out[f"{name}.{moment}"] = state[moment].detach() if moment in state else torch.zeros_like(param)
        for key, (_, leaf, moment) in self._piece_moments().items():
            state = self.optimizer.state.get(leaf, {})
            out[key] = state[moment].detach() if moment in state else torch.zeros_like(leaf)
        out["step"] = torch.tensor(self.step, dtype=torch.int64)
        out[UPDATES_KEY] = torch.tensor(self.optimizer_steps, dtype=torch.int64)
        if self.scaler is not None:
            out.update(self.scaler.state())
        return out

    def _sharded_names(self) -> set[str]:
        """Parameters whose optimizer state is sharded across their holders (none without sharding)."""
        return self.sync.sharded if isinstance(self.sync, ShardedGradSync) else set()

    def _piece_moments(self) -> dict[str, tuple[ShardSpec, torch.Tensor, str]]:
        """Checkpoint key -> (its slice of the moment's full tensor, the optimizer leaf, moment name) for every
        piece of this rank (semantics/optimizer_shards.py); each piece has one holder, who saves it."""
        if not isinstance(self.sync, ShardedGradSync):
            return {}
        out: dict[str, tuple[ShardSpec, torch.Tensor, str]] = {}
        for piece, leaf in self.sync.leaves.items():
            shape = self.params[piece.name][0].shape
            for moment in MOMENTS:
                spec = ShardSpec(f"{piece.name}.{moment}", shape, piece.dim, piece.start, piece.stop, True)
                out[spec.key] = (spec, leaf, moment)
        return out

    def checkpoint_shards(self) -> dict[str, ShardSpec]:
        """The ShardSpec of every key of `state_for_checkpoint` (what `checkpoint.dcp.save` takes)."""
        out = shards_for(self.state_for_checkpoint(), self._specs, self.rank)
        out.update({key: spec for key, (spec, _, _) in self._piece_moments().items()})
        return out

    def _scalar_defaults(self, step: int) -> dict[str, torch.Tensor]:
        """What a checkpoint without the optional scalars means: no skipped step, the initial loss scale."""
        out = {UPDATES_KEY: torch.tensor(step, dtype=torch.int64)}
        if self.scaler is not None:
            out[SCALE_KEY] = torch.tensor(self.scaler.config.init_scale, dtype=torch.float32)
            out[TRACKER_KEY] = torch.tensor(0, dtype=torch.int32)
        return out

    def _restore_scalars(self, step: int, scalars: dict[str, torch.Tensor]) -> None:
        """Take over the step counts and the loss scale (`scalars`: the keys of `_scalar_defaults`)."""
        updates = int(scalars[UPDATES_KEY].item())
        if not 0 <= updates <= step:
            raise InputError(f"checkpoint optimizer_steps {updates} is not within 0..step {step}")
        self.step, self.optimizer_steps = step, updates
        if self.scaler is not None:
            self.scaler.load(float(scalars[SCALE_KEY].item()), int(scalars[TRACKER_KEY].item()))

    def load_from_full(self, get_full: Callable[[str], torch.Tensor]) -> None:
        """Load this rank's shards of params and AdamW moments, the step counts and the loss scale, from FULL
        fp32 tensors (`get_full(key)` for the keys of `state_for_checkpoint`; a KeyError for an optional scalar
        leaves its default), whatever plan saved them."""
        self.wait_for_parameters()  # a gather landing later would overwrite what is loaded
        step = int(get_full("step").item())
        with torch.no_grad():
            for name, (info, param) in self.params.items():
                param.copy_(self._shard(info, get_full(name)))
        scalars = self._scalar_defaults(step)
        for key in scalars:
            try:
                scalars[key] = get_full(key)
            except KeyError:
                pass
            if scalars[key].numel() != 1:
                raise InputError(f"checkpoint {key}: shape {list(scalars[key].shape)}, a scalar expected")
        updates = int(scalars[UPDATES_KEY].item())
        sharded = self._sharded_names()
        with torch.no_grad():
            for name, (info, param) in self.params.items():
                if name in sharded:
                    continue
                if updates > 0:
                    restore_moments(self.optimizer, param, updates,
                                    *(self._shard(info, get_full(f"{name}.{m}")).clone() for m in MOMENTS))
                else:
                    restore_moments(self.optimizer, param, 0)
            if isinstance(self.sync, ShardedGradSync):
                for piece, leaf in self.sync.leaves.items():
                    info = self.params[piece.name][0]
                    moments = [self.sync.piece_view(piece, self._shard(info, get_full(f"{piece.name}.{m}"))).clone()
                               for m in MOMENTS] if updates > 0 else []
                    restore_moments(self.optimizer, leaf, updates, *moments)
        self._restore_scalars(step, scalars)

    def _shard(self, info: ParamInfo, full: torch.Tensor) -> torch.Tensor:
        if tuple(full.shape) != info.shape:
            raise InputError(f"{info.name}: checkpoint shape {list(full.shape)}, model shape {list(info.shape)}")
        return info.take(full.to(self.device, torch.float32), self.tp.size, self.tp.rank)

    def _gather(self, info: ParamInfo, local: torch.Tensor) -> torch.Tensor:
        """The full tensor from this TP group's shards (collective over the TP group)."""
        if info.shard_dim is None or self.tp.size == 1:
            return local.detach().clone()
        sizes = [info.local_shape(self.tp.size, t)[info.shard_dim] for t in range(self.tp.size)]
        pad_shape = list(local.shape)
        pad_shape[info.shard_dim] = max(sizes)
        padded = torch.zeros(pad_shape, dtype=local.dtype, device=local.device)
        padded.narrow(info.shard_dim, 0, local.shape[info.shard_dim]).copy_(local)
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=self.tp.group)
        return torch.cat([p.narrow(info.shard_dim, 0, n) for p, n in zip(parts, sizes, strict=True)],
                         dim=info.shard_dim)

    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        """Full gradient tensors (after DP sync and clipping) of this rank's params (collective over TP group)."""
        out = {}
        sharded = self._gathered_grads()
        for name, (info, param) in self.params.items():
            grad = sharded.get(name, param.grad if param.grad is not None else torch.zeros_like(param))
            out[name] = self._gather(info, grad).cpu()
        return out

    def _gathered_grads(self) -> dict[str, torch.Tensor]:
        """The reduced local gradients of the sharded parameters, all-gathered from the holders' pieces
        (collective over the DP groups; test helper)."""
        if not isinstance(self.sync, ShardedGradSync):
            return {}
        sync = self.sync
        out = {name: torch.zeros_like(self.params[name][1]).detach() for name in sync.sharded}
        sync.gather(lambda piece: sync.leaves[piece].grad if sync.leaves[piece].grad is not None
                    else torch.zeros_like(sync.leaves[piece]),
                    lambda piece: sync.piece_view(piece, out[piece.name]))
        return out

    def gather_full_state(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU tensors of this rank's entries of `state_for_checkpoint` (collective over the TP
        group): what `load_from_full` takes, under any plan."""
        out: dict[str, torch.Tensor] = {}
        local = {**self.state_for_checkpoint(), **self._gathered_moments()}
        for name, (info, _) in self.params.items():
            for key in (name, f"{name}.exp_avg", f"{name}.exp_avg_sq"):
                out[key] = self._gather(info, local[key]).cpu()
        for key in ("step", *self._scalar_defaults(0)):
            out[key] = local[key]
        return out

    def _gathered_moments(self) -> dict[str, torch.Tensor]:
        """The local (TP-shard) moments "<name>.<moment>" of every sharded parameter, all-gathered from the
        holders' pieces (collective over the DP groups; test and export helper, not the checkpoint path)."""
        if not isinstance(self.sync, ShardedGradSync):
            return {}
        out = {f"{name}.{m}": torch.zeros_like(self.params[name][1]).detach() for name in self.sync.sharded
               for m in MOMENTS}
        for moment in MOMENTS:
            def own(piece: ShardPiece, moment: str = moment) -> torch.Tensor:
                state = self.optimizer.state.get(self.sync.leaves[piece], {})  # type: ignore[union-attr]
                return state[moment] if moment in state else torch.zeros_like(self.sync.leaves[piece])  # type: ignore[union-attr]
            self.sync.gather(own, lambda piece, moment=moment: self.sync.piece_view(  # type: ignore[union-attr]
                piece, out[f"{piece.name}.{moment}"]))
        return out

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Full parameter tensors of this rank's params (collective over the TP group)."""
        self.wait_for_parameters()
        return {name: self._gather(info, param).cpu() for name, (info, param) in self.params.items()}


    def load_local(self, fill: Callable[[dict[str, tuple[ShardSpec, torch.Tensor]]], None]) -> None:
        """Load this rank's shards of params and AdamW moments, the step counts and the loss scale, in place,
        whatever plan saved them: `fill(targets)` writes into each target tensor the saved values of the slice its
        ShardSpec names (keys: those of `state_for_checkpoint`), e.g. `lambda t: checkpoint.load_into(path, t)`;
        targets whose ShardSpec is `optional` (the scalars a checkpoint may lack) hold their default and are left
        as they are when the checkpoint lacks them. No full tensor is built here: host memory grows by the two
        moments (on CPU) plus what `fill` holds at once."""
        self.wait_for_parameters()  # a gather landing later would overwrite what is loaded
        targets: dict[str, tuple[ShardSpec, torch.Tensor]] = {}
        moments: dict[str, dict[str, torch.Tensor]] = {}
        sharded = self._sharded_names()
        pieces = {key: (spec, torch.empty_like(leaf), leaf, moment)
                  for key, (spec, leaf, moment) in self._piece_moments().items()}
        targets.update({key: (spec, buf) for key, (spec, buf, _, _) in pieces.items()})
        for spec in self._specs:
            param = self.params[spec.name][1].detach()
            targets[spec.name] = (spec, param)
            if spec.name in sharded:
                continue
            for m in MOMENTS:
                buf = moments.setdefault(spec.name, {})[m] = torch.empty_like(param)
                targets[f"{spec.name}.{m}"] = (ShardSpec(f"{spec.name}.{m}", spec.full_shape, spec.dim, spec.start,
                                                         spec.stop, spec.owner), buf)
        step = torch.zeros((), dtype=torch.int64)
        targets["step"] = (ShardSpec("step", (), None, 0, 1, self.rank == 0), step)
        scalars = self._scalar_defaults(-1)  # -1: "optimizer_steps" absent from the checkpoint, read as "step"
        for key, value in scalars.items():
            targets[key] = (ShardSpec(key, (), None, 0, 1, self.rank == 0, optional=True), value)
        with torch.no_grad():
            fill(targets)
        steps = int(step.item())
        if int(scalars[UPDATES_KEY].item()) < 0:
            scalars[UPDATES_KEY].fill_(steps)
        updates = int(scalars[UPDATES_KEY].item())
        for name, (_, param) in self.params.items():
            if name not in sharded:
                restore_moments(self.optimizer, param, updates, moments[name]["exp_avg"],
                                moments[name]["exp_avg_sq"])
        by_leaf: dict[int, dict[str, torch.Tensor]] = {}
        for _, buf, leaf, moment in pieces.values():
            by_leaf.setdefault(id(leaf), {"leaf": leaf})[moment] = buf
        for found in by_leaf.values():
            restore_moments(self.optimizer, found["leaf"], updates, found["exp_avg"], found["exp_avg_sq"])
        self._restore_scalars(steps, scalars)

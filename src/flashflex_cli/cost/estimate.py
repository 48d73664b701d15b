"""estimate(plan, cluster): iteration time, throughput, MFU, memory per device, for any asymmetric plan.

Iteration = for every stage, the end of its last backward (1F1B simulation of its pipeline), then the
part of its DP gradient reduction that is not hidden behind the backward (cost/dp.py: per-layer buckets
against the last backward, flat or hierarchical), then its optimizer step; the latest stage sets the
iteration time. docs/cost-model.md writes the formulas out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..hardware.cluster import Cluster
from ..model import flops as model_flops
from ..plan.predicted import Predicted
from ..plan.schema import Plan
from ..semantics.optimizer_shards import ShardCounts, shard_counts
from ..semantics.process_groups import communicator_groups
from ..units import byte_size
from .comm import p2p_time
from .compute import layer_times, weight_cast_s
from .dp import StageBackward, dp_buckets, dp_partners, dp_timeline
from .measured import MeasuredCosts
from .memory import (
    MemoryBreakdown,
    device_capacity,
    device_reserve,
    group_bytes,
    is_cuda_group,
    stage_memory,
    stage_params_per_device,
)
from .optimizer_shards import gather_timeline, reduce_scatter_bucket, shards_optimizer
from .params import CostParams
from .schedule import simulate_1f1b, stage_pass_s
from .traffic import OPTIMIZER_BYTES_PER_PARAM
from .view import ClusterView, view


@dataclass(frozen=True)
class StageEstimate:
    """One stage: per-micro-batch fwd_s/bwd_s (s), p2p_s to the next stage (s, 0 for the last), time_s =
    busy compute time per iteration (s), dp_s = seconds of the DP reductions it takes part in, hidden or not,
    dp_exposed_s = how long its reduction runs on after its last backward (s), memory per device (bytes),
    memory_capacity = the smallest usable capacity among its devices (bytes), headroom = capacity - need.
    not_native_on: the device types of the stage that lack the training dtype (no tensor cores for it), sorted;
    they compute it at no more than their fp32 rate unless a layer profile measured in the dtype says otherwise."""

    pipeline: int
    stage: int
    devices: tuple[str, ...]
    tp: int
    layers: tuple[int, int]
    fwd_s: float
    bwd_s: float
    p2p_s: float
    time_s: float
    memory: MemoryBreakdown
    memory_capacity: float
    headroom_bytes: float
    dp_s: float = 0.0
    optimizer_s: float = 0.0
    end_s: float = 0.0
    source: str = "modelled"
    extrapolated: bool = False
    tp_comm_s: float = 0.0
    profile_sha256: str = ""
    num_micro_batches: int = 0
    dp_exposed_s: float = 0.0
    on_cuda: bool = True
    not_native_on: tuple[str, ...] = ()
    weight_cast_s: float = 0.0  # cast_once: the step's one cast of the layers' weights (s), before its schedule


@dataclass(frozen=True)
class PipelineEstimate:
    """One pipeline: 1F1B time (s), idle share, tokens per iteration, micro-batches."""

    time_s: float
    bubble_fraction: float
    tokens: int
    num_micro_batches: int = 0
    micro_batch_size: int = 0


@dataclass(frozen=True)
class Estimate:
    """The cost model's answer for one plan on one cluster (SI units)."""

    iteration_time_s: float
    tokens_per_s: float
    mfu: float
    model_flops_per_token: float
    peak_flops_used: float
    dp_exposed_s: float
    pipelines: list[PipelineEstimate]
    stages: list[StageEstimate]
    fits: bool
    problems: list[str] = field(default_factory=list)
    optimizer_s: float = 0.0

    def prediction(self) -> Predicted:
        """Plan.predicted of this estimate (`to_predicted` as the typed model)."""
        return Predicted.model_validate(self.to_predicted())

    def to_predicted(self) -> dict[str, Any]:
        """JSON-ready dict of Plan.predicted: stable key order, floats to 6 significant digits (byte-stable plan
        files)."""
        return {
            "iteration_time_s": _r(self.iteration_time_s),
            "tokens_per_s": _r(self.tokens_per_s),
            "mfu": _r(self.mfu),
            "fits": self.fits,
            "model_flops_per_token": _r(self.model_flops_per_token),
            "peak_flops_used": _r(self.peak_flops_used),
            "dp_exposed_s": _r(self.dp_exposed_s),
            "optimizer_s": _r(self.optimizer_s),
            "pipelines": [
                {"time_s": _r(p.time_s), "bubble_fraction": _r(p.bubble_fraction), "tokens": p.tokens}
                for p in self.pipelines
            ],
            "stages": [_stage_json(s) for s in self.stages],
            "problems": list(self.problems),
        }

    def profiles_used(self) -> list[str]:
        """sha256 of every layer profile a stage was costed from, sorted."""
        return sorted({s.profile_sha256 for s in self.stages if s.profile_sha256})


def _stage_json(s: StageEstimate) -> dict[str, Any]:
    """One stage's prediction with its full breakdown (seconds per micro-batch unless named per step);
    `dtype_not_native_on` only for a stage whose devices lack the training dtype."""
    out: dict[str, Any] = {
        "pipeline": s.pipeline,
        "stage": s.stage,
        "source": s.source + (" (extrapolated)" if s.extrapolated else ""),
        "time_s": _r(s.time_s),
        "fwd_s": _r(s.fwd_s),
        "bwd_s": _r(s.bwd_s),
        "tp_comm_s": _r(s.tp_comm_s),
        "p2p_s": _r(s.p2p_s),
        "dp_s": _r(s.dp_s),
        "dp_exposed_s": _r(s.dp_exposed_s),
        "optimizer_s": _r(s.optimizer_s),
        "end_s": _r(s.end_s),
        "memory_bytes": _r(s.memory.total),
        "memory_phase": s.memory.phase,
        "memory": {name: _r(value) for name, value in s.memory.as_dict().items()},
        "memory_capacity_bytes": _r(s.memory_capacity),
        "headroom_bytes": _r(s.headroom_bytes),
    }
    if s.not_native_on:
        out["dtype_not_native_on"] = list(s.not_native_on)
    return out


def _not_native_on(cv: ClusterView, devices: list[str], dtype: str) -> tuple[str, ...]:
    """The device types among `devices` that lack `dtype` (compute it on their fp32 units), sorted."""
    return tuple(sorted({cv.info(d).type for d in devices if cv.compute_dtype(d, dtype) != dtype}))


def _r(value: float) -> float:
    """Round to 6 significant digits so plan files are byte-stable."""
    return float(f"{value:.6g}")


def stage_nccl_bytes(plan: Plan, cluster: Cluster, params: CostParams) -> dict[tuple[int, int], float]:
    """The most bytes of NCCL communicators any rank of each stage holds, by (pipeline, stage): every group the
    runtime creates for the plan that the rank belongs to (semantics/process_groups.communicator_groups), each
    charged by its fabric (cost/memory.group_bytes)."""
    devices = [info.device for info in plan.ranks()]
    cost: dict[tuple[int, ...], float] = {}
    per_rank = [0.0] * len(devices)
    for members in communicator_groups(plan):
        found = cost.get(members)
        if found is None:
            found = cost[members] = group_bytes(cluster, [devices[r] for r in members], params)
        for r in members:
            per_rank[r] += found
    out: dict[tuple[int, int], float] = {}
    for info in plan.ranks():
        key = (info.pipeline, info.stage)
        out[key] = max(out.get(key, 0.0), per_rank[info.rank])
    return out


def stage_optimizer_shards(plan: Plan) -> dict[tuple[int, int], ShardCounts]:
    """Per (pipeline, stage): the ShardCounts (semantics/optimizer_shards.py) of the stage's rank that keeps the
    most optimizer state; all zero unsharded."""
    counts = shard_counts(plan)
    out: dict[tuple[int, int], ShardCounts] = {}
    for info in plan.ranks():
        key, mine = (info.pipeline, info.stage), counts[info.rank]
        if key not in out or mine.own - mine.held > out[key].own - out[key].held:
            out[key] = mine
    return out


def plan_stage_memory(plan: Plan, cluster: Cluster, params: CostParams, p: int, s: int,
                      measured: MeasuredCosts | None, dp_shared: bool, nccl_bytes: float = 0.0,
                      optimizer_shard: ShardCounts = ShardCounts()) -> MemoryBreakdown:
    """Peak memory per device of stage `s` of pipeline `p` (cost/memory.py), given its layer profile costs
    `measured` (None: counted), whether it has DP partners, its ranks' NCCL communicators (`stage_nccl_bytes`)
    and its optimizer shard (`stage_optimizer_shards`)."""
    model, train = plan.inputs.model, plan.inputs.train
    pipe = plan.pipelines[p]
    stage, count, m = pipe.stages[s], len(pipe.stages), pipe.num_micro_batches
    reserve = max(device_reserve(cluster, d, params) for d in stage.devices)
    return stage_memory(model, train, stage.tp, stage.num_layers, s == 0, s == count - 1, min(count - s, m), params,
                        micro_batch_size=pipe.micro_batch_size, reserve_bytes=reserve, measured=measured,
                        num_micro=m, on_cuda=is_cuda_group(cluster, stage.devices), dp_shared=dp_shared,
                        warmup=min(count - s - 1, m), nccl_bytes=nccl_bytes, optimizer_shard=optimizer_shard)


def plan_memory(plan: Plan, cluster: Cluster, params: CostParams | None = None) -> dict[tuple[int, int], MemoryBreakdown]:
    """Every stage's peak memory per device by (pipeline, stage), counted (no layer profile, no time): what
    `launch`'s preflight checks each rank against."""
    params = params or CostParams()
    partners = dp_partners(dp_buckets(plan, cluster, params))
    comms = stage_nccl_bytes(plan, cluster, params)
    shards = stage_optimizer_shards(plan)
    return {(p, s): plan_stage_memory(plan, cluster, params, p, s, None, bool(partners.get((p, s))), comms[(p, s)],
                                      shards[(p, s)])
            for p, pipe in enumerate(plan.pipelines) for s in range(len(pipe.stages))}


def estimate(plan: Plan, cluster: Cluster, params: CostParams | None = None) -> Estimate:
    """Predict one training iteration of `plan` on `cluster`; infeasibility goes to fits/problems."""
    params = params or CostParams()
    model, train = plan.inputs.model, plan.inputs.train
    cv = view(cluster)
    stages: list[StageEstimate] = []
    pipelines: list[PipelineEstimate] = []
    problems: list[str] = []
    last_backward: dict[tuple[int, int], float] = {}
    dp_plan = dp_buckets(plan, cluster, params)
    partners = dp_partners(dp_plan)
    comms = stage_nccl_bytes(plan, cluster, params)
    shards = stage_optimizer_shards(plan)
    paths = {on_cuda: params.runtime.resolved(on_cuda) for on_cuda in (False, True)}
    backward: dict[tuple[int, int], StageBackward] = {}
    for p, pipe in enumerate(plan.pipelines):
        mbs, m, count = pipe.micro_batch_size, pipe.num_micro_batches, len(pipe.stages)
        fwd, bwd, p2p, back, times = [], [], [], [], []
        for s, stage in enumerate(pipe.stages):
            lt = layer_times(cluster, stage.devices, model, train, params, micro_batch_size=mbs)
            times.append(lt)
            n = stage.num_layers
            first, last = s == 0, s == count - 1
            fwd.append(stage_pass_s(n, lt.fwd_s, lt.embed_fwd_s, lt.head_fwd_s, first, last))
            bwd.append(stage_pass_s(n, lt.bwd_s, lt.embed_bwd_s, lt.head_bwd_s, first, last))
            if s + 1 < count:
                nxt = pipe.stages[s + 1].devices
                p2p.append(p2p_time(cluster, stage.devices, nxt, model, train, params, micro_batch_size=mbs))
                back.append(p2p_time(cluster, nxt, stage.devices, model, train, params, micro_batch_size=mbs))
        sched = simulate_1f1b(fwd, bwd, p2p, m, p2p_back_s=back)
        pipelines.append(PipelineEstimate(sched.total_s, sched.bubble_fraction, pipe.sequences * train.seq_len, m, mbs))
        for s, stage in enumerate(pipe.stages):
            lt = times[s]
            mem = plan_stage_memory(plan, cluster, params, p, s, lt.measured, bool(partners.get((p, s))),
                                    comms[(p, s)], shards[(p, s)])
            capacity, tightest = min((device_capacity(cluster, d, params), d) for d in stage.devices)
            headroom = capacity - mem.total
            if headroom < 0:
                problems.append(f"pipelines.{p}.stages.{s}: needs {byte_size(mem.total)} at its peak "
                                f"({mem.phase}), {tightest} allows {byte_size(capacity)}")
            last_backward[(p, s)] = sched.last_backward_end_s[s]
            backward[(p, s)] = StageBackward(sched.last_backward_end_s[s] - bwd[s], sched.last_backward_end_s[s],
                                             lt.head_bwd_s if s == count - 1 else 0.0, lt.bwd_s,
                                             (stage.layers[0], stage.layers[1]), s == 0)
            stages.append(StageEstimate(
                p, s, tuple(stage.devices), stage.tp, tuple(stage.layers), fwd[s], bwd[s],
                p2p[s] if s < len(p2p) else 0.0, sched.busy_s[s], mem, capacity, headroom,
                source=lt.source, extrapolated=bool(lt.measured and lt.measured.extrapolated),
                tp_comm_s=stage.num_layers * (lt.tp_fwd_s + lt.tp_bwd_s),
                profile_sha256=lt.measured.sha256 if lt.measured else "", num_micro_batches=m,
                on_cuda=is_cuda_group(cluster, stage.devices),
                not_native_on=_not_native_on(cv, stage.devices, train.dtype)))

    final: list[StageEstimate] = []
    iteration = 0.0
    sharded = shards_optimizer(plan)
    dp = dp_timeline([reduce_scatter_bucket(b) for b in dp_plan] if sharded else dp_plan, backward,
                     params.dp_overlap, partners)
    for st in stages:
        key = (st.pipeline, st.stage)
        comm = dp.stage_seconds.get(key, 0.0)
        comm_end = dp.end_s[key]
        last = st.stage == len(plan.pipelines[st.pipeline].stages) - 1
        n_params = sum(stage_params_per_device(model, st.tp, st.layers[1] - st.layers[0], st.stage == 0, last))
        n_params += shards[key].own - shards[key].held  # sharded: the update covers what this stage keeps
        membw = min(cv.info(d).memory_bandwidth for d in st.devices) * params.memory_bandwidth_efficiency
        optimizer = paths[st.on_cuda].optimizer
        opt = n_params * OPTIMIZER_BYTES_PER_PARAM[str(optimizer)] / membw
        # the next step's cast follows the update; its schedule waits for it
        cast = weight_cast_s(cluster, st.devices, model, train, params, st.layers[1] - st.layers[0])
        end = comm_end + opt + cast
        iteration = max(iteration, end)
        final.append(replace(st, dp_s=comm, optimizer_s=opt, end_s=end, weight_cast_s=cast,
                             dp_exposed_s=max(0.0, comm_end - last_backward[key])))

    if sharded:  # each holder's updated chunk gathered by the others after the update
        gathered = gather_timeline(dp_plan, {(st.pipeline, st.stage): st.end_s for st in final})
        final = [replace(st, end_s=gathered[(st.pipeline, st.stage)]) for st in final]
        iteration = max(st.end_s for st in final)
    slowest_pipeline = max(p.time_s for p in pipelines)
    optimizer_s = max(st.optimizer_s for st in final)
    dp_exposed = max(0.0, max(st.end_s - st.optimizer_s - st.weight_cast_s for st in final) - slowest_pipeline)
    tokens = train.global_batch * train.seq_len
    tokens_per_s = tokens / iteration if iteration > 0 else 0.0
    mfpt = model_flops.model_flops_per_token(model, train.seq_len)
    peak = sum(cv.peak(d, train.dtype) for st in final for d in st.devices)
    mfu = mfpt * tokens_per_s / peak if peak > 0 else 0.0
    return Estimate(iteration, tokens_per_s, mfu, mfpt, peak, dp_exposed, pipelines, final,
                    not problems, problems, optimizer_s)

"""A candidate layout: pipelines with their layer splits, a batch split, and the fast score.

The fast score approximates the iteration time (seconds): every pipeline's time under its micro-batch
share (`batch_split.split_batch`, each pipeline's time in the cost model's closed form of 1F1B,
`cost.schedule.closed_form_s`) and the data-parallel reduction after (or, overlapped, during) its backward, per
layer the way cost/dp.py does (`dp_score.dp_finish`). Candidates are ranked by this score; the finalists are then
built as `Plan`s and ranked by `cost.estimate.estimate` alone (the single source of truth).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ...cost.estimate import estimate
from ...cost.schedule import closed_form_s
from ...physical_limits import MICRO_BATCHES
from ...plan.schema import PipelinePlan, Plan, PlanInputs, StagePlan, UnusedDevice
from ..space.batch_split import split_batch
from .cost_cache import CostCache
from .dp_score import dp_finish_below, dp_finish_floor
from .pipeline_score import PipeEval


@dataclass(frozen=True)
class Candidate:
    """Pipelines (in canonical order), their micro-batch counts, the fast score in seconds, and each
    pipeline's micro-batch size in sequences (None: the training configuration's, for every pipeline)."""

    pipes: tuple[PipeEval, ...]
    micro: tuple[int, ...]
    score_s: float
    mbs: tuple[int, ...] | None = None

    @cached_property
    def used(self) -> frozenset[int]:
        """Device indices the candidate uses."""
        return frozenset(i for pipe in self.pipes for i in pipe.devices)

    def signature(self) -> tuple:
        """Canonical identity of the layout (for de-duplication and deterministic tie-breaks)."""
        base = tuple((pipe.stages, pipe.counts, m) for pipe, m in zip(self.pipes, self.micro, strict=True))
        return base if self.mbs is None else (*base, self.mbs)


def score(cache: CostCache, pipes: list[PipeEval] | tuple[PipeEval, ...], total_micro: int,
          bound: float = float("inf")) -> Candidate | None:
    """Batch-split `pipes` and score them; None when a pipeline does not fit or the batch is too small, or
    when a lower bound (the slowest pipeline, then `dp_score.dp_finish_floor`, then the data-parallel timeline of
    the pipelines already known, `dp_score.dp_finish_below`) already reaches `bound` seconds (the score can only be
    larger, so the data-parallel term is not computed in full)."""
    if not pipes or not all(pipe.ok for pipe in pipes):
        return None
    ordered = tuple(sorted(pipes, key=lambda pipe: pipe.first_device))
    micro = split_batch(total_micro, [p.pace_s for p in ordered], [p.fill_s - p.pace_s for p in ordered],
                        [p.num_stages for p in ordered])
    if micro is None or max(micro) > MICRO_BATCHES.high:  # more than a plan may hold (physical_limits.py)
        return None
    ends = [closed_form_s(p.pace_s, p.fill_s, m) for p, m in zip(ordered, micro, strict=True)]
    if max(ends) >= bound or (bound < float("inf") and dp_finish_floor(cache, ordered, ends) >= bound):
        return None
    finish = dp_finish_below(cache, ordered, ends, bound)
    return None if finish is None else Candidate(ordered, tuple(micro), finish)


def build_plan(cache: CostCache, cand: Candidate, strategy: str, seed: int,
               unused: dict[str, str] | None = None, predict: bool = True) -> Plan:
    """The `Plan` of a candidate, with `predicted` from the cost model's `estimate`."""
    g, train, model = cache.graph, cache.train, cache.model
    pipelines = []
    sizes = cand.mbs or (cache.micro_batch,) * len(cand.pipes)
    for pipe, micro, mbs in zip(cand.pipes, cand.micro, sizes, strict=True):
        start, stages = 0, []
        for devs, n in zip(pipe.stages, pipe.counts, strict=True):
            stages.append(StagePlan(devices=[g.ids[i] for i in devs], tp=len(devs), layers=(start, start + n)))
            start += n
        pipelines.append(PipelinePlan(micro_batch_size=mbs, num_micro_batches=micro, stages=stages))
    used = cand.used
    reasons = unused or {}
    idle = [UnusedDevice(device=g.ids[i], reason=reasons.get(g.ids[i], "the fastest plan found leaves it idle"))
            for i in range(g.size) if i not in used]
    inputs = PlanInputs(cluster_sha256=g.cluster_sha256, cluster_name=g.cluster.name, model=model, train=train,
                        strategy=strategy, seed=seed)
    plan = Plan(inputs=inputs, pipelines=pipelines, unused_devices=idle)
    if predict:
        plan = plan.model_copy(update={"predicted": estimate(plan, g.cluster, cache.params).prediction()})
    return plan

"""Predicted (cost/estimate.py) against measured (a run folder) per stage, term by term.

Terms, per stage (seconds per step unless named per micro-batch; memory in bytes):
  forward, backward   compute of all micro-batches (measured: forward_s, backward_s; TP collectives included);
  forward/mb, backward/mb   the same per micro-batch;
  p2p                 pipeline sends and receives (predicted: m x (transfer to the next stage + transfer from
                      the previous one); measured: time inside the exchanges, waits for the peer included);
  bubble              idle time in the 1F1B schedule (predicted: pipeline time - busy compute; measured:
                      pipeline_s - forward - backward, or without pipeline_s, step time - forward - backward -
                      dp - optimizer), so measured p2p waits count here too;
  dp                  the EXPOSED data-parallel gradient reduction: what runs on after the stage's schedule
                      (predicted: dp_exposed_s, the per-layer overlap simulated; measured: dp_s, the wait
                      after the schedule); optimizer: the optimizer step;
  memory              peak per device: on GPUs the allocated peak (measured: torch.cuda.max_memory_allocated),
                      on CPU devices the total (measured: max RSS, the interpreter included);
  memory growth       what training adds to the built stage: predicted the same less the weights; measured the
                      peak above what the rank held before its first step (absent for runs recorded before).
Measured values are medians over the run's steps, the first (warm-up) left out (runs/reader.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cost.estimate import Estimate, StageEstimate
from ..plan.schema import Plan
from .reader import RunRecord, check_matches

STEP_TERMS = ("forward", "backward", "p2p", "bubble", "dp", "optimizer")


@dataclass(frozen=True)
class Term:
    """One quantity of one stage: predicted and measured (None when the run did not record it), in `unit`
    ("s" seconds or "B" bytes)."""

    name: str
    predicted: float
    measured: float | None
    unit: str = "s"

    @property
    def ratio(self) -> float | None:
        """measured / predicted, None when either is missing or nothing was predicted (below a microsecond or a
        byte: a difference of two sums that rounds, not a prediction)."""
        if self.measured is None or self.predicted < (1e-6 if self.unit == "s" else 1.0):
            return None
        return self.measured / self.predicted

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        ratio = self.ratio
        return {"term": self.name, "unit": self.unit, "predicted": self.predicted, "measured": self.measured,
                "ratio": None if ratio is None else round(ratio, 4)}


@dataclass(frozen=True)
class StageComparison:
    """The terms of one stage (see the module docstring)."""

    pipeline: int
    stage: int
    devices: tuple[str, ...]
    num_micro_batches: int
    terms: tuple[Term, ...]
    on_cuda: bool = False  # its "memory" measured is then the allocator's peak, else the process's resident peak

    def term(self, name: str) -> Term:
        """The term called `name`."""
        return next(t for t in self.terms if t.name == name)


@dataclass(frozen=True)
class RunComparison:
    """Every stage's terms, the predicted and measured step time (seconds), how many steps the medians used,
    and the (stage, term) off most: the largest absolute seconds difference over a step. `loss_scaling`: fp16
    runs' (steps, steps skipped, last loss scale), else None."""

    stages: tuple[StageComparison, ...]
    predicted_step_s: float
    measured_step_s: float
    steps_used: int
    worst: tuple[int, int, str, float] | None
    loss_scaling: tuple[int, int, float] | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the "run_comparison" object of `flashflex show --run --json`)."""
        worst = None
        if self.worst is not None:
            p, s, name, diff = self.worst
            worst = {"pipeline": p, "stage": s, "term": name, "measured_minus_predicted_s": round(diff, 6)}
        out: dict[str, Any] = {
            "predicted_step_s": self.predicted_step_s, "measured_step_s": self.measured_step_s,
            "steps_used": self.steps_used,
            "stages": [{"pipeline": c.pipeline, "stage": c.stage, "devices": list(c.devices),
                        "num_micro_batches": c.num_micro_batches, "terms": [t.to_json() for t in c.terms]}
                       for c in self.stages],
            "off_most": worst,
        }
        if self.loss_scaling is not None:
            steps, skipped, scale = self.loss_scaling
            out["loss_scaling"] = {"steps": steps, "skipped_steps": skipped, "last_scale": scale}
        return out


def _minus(total: float | None, *parts: float | None) -> float | None:
    if total is None or any(p is None for p in parts):
        return None
    return max(0.0, total - sum(p for p in parts if p is not None))


def _stage_terms(st: StageEstimate, prev_p2p_s: float, pipeline_s: float, run: RunRecord) -> tuple[Term, ...]:
    m = st.num_micro_batches
    value = lambda key: run.stage_value(st.pipeline, st.stage, key)  # noqa: E731
    fwd, bwd = value("forward_s"), value("backward_s")
    dp, opt = value("dp_s"), value("optimizer_s")
    p2p = value("p2p_s")
    if p2p is None:  # runs before p2p_s and dp_s were told apart: comm_s holds both
        p2p = value("comm_s")
    measured_pipeline = value("pipeline_s")
    if measured_pipeline is not None:
        bubble = _minus(measured_pipeline, fwd, bwd)
    else:
        bubble = _minus(run.step_time_s(), fwd, bwd, dp or 0.0, opt)
    per_mb = lambda x: None if x is None else x / m  # noqa: E731
    # a GPU run records the caching allocator's peak (max_memory_allocated), a CPU run the process's RSS
    memory = st.memory.allocated if st.on_cuda else st.memory.total
    return (
        Term("forward/mb", st.fwd_s, per_mb(fwd)),
        Term("backward/mb", st.bwd_s, per_mb(bwd)),
        Term("forward", m * st.fwd_s, fwd),
        Term("backward", m * st.bwd_s, bwd),
        Term("p2p", m * (st.p2p_s + prev_p2p_s), p2p),
        Term("bubble", max(0.0, pipeline_s - st.time_s), bubble),
        Term("dp", st.dp_exposed_s, dp),  # exposed: the runtime's dp_s is the wait after the schedule
        Term("optimizer", st.optimizer_s, opt),
        Term("memory", memory, run.memory_bytes(st.pipeline, st.stage), unit="B"),
        Term("memory growth", memory - st.memory.weights,
             run.stage_value(st.pipeline, st.stage, "memory_growth_bytes"), unit="B"),
    )


def compare_run(plan: Plan, estimate: Estimate, run: RunRecord) -> RunComparison:
    """Predicted against measured for every stage of `plan` (InputError when the run does not match it)."""
    check_matches(run, plan)
    by_key = {(st.pipeline, st.stage): st for st in estimate.stages}
    out: list[StageComparison] = []
    worst: tuple[int, int, str, float] | None = None
    for p, pipe in enumerate(plan.pipelines):
        for s in range(len(pipe.stages)):
            st = by_key[(p, s)]
            prev = by_key[(p, s - 1)].p2p_s if s > 0 else 0.0
            terms = _stage_terms(st, prev, estimate.pipelines[p].time_s, run)
            out.append(StageComparison(p, s, st.devices, pipe.num_micro_batches, terms, st.on_cuda))
            for t in terms:
                if t.name in STEP_TERMS and t.measured is not None:
                    diff = t.measured - t.predicted
                    if worst is None or abs(diff) > abs(worst[3]):
                        worst = (p, s, t.name, diff)
    return RunComparison(tuple(out), estimate.iteration_time_s, run.step_time_s(), len(run.used_rows), worst,
                         run.loss_scaling())

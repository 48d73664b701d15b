"""`flashflex plan --dtype auto`: the precision a fleet trains in, chosen by the cost model.

bf16 when every device the planner may use computes it natively: one plan, no comparison. Otherwise both
bf16 (the devices that lack it costed at no more than their fp32 rate, or left idle where they do not pay)
and fp16 are planned, and the better by the objective is kept: more tokens/s, or for `--objective cost`
fewer currency units per million tokens; a tie keeps bf16 (it needs no loss scaling). At most two plans.
The reason is one deterministic line (figures from the plans' own predictions), recorded in the plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...errors import FlashflexError
from ...hardware.cluster import Cluster
from ...plan.schema import Plan

AUTO = "auto"
AUTO_DTYPES = ("bf16", "fp16")  # in order of preference on a tie
DTYPE_CHOICES = ("bf16", "fp16", "fp32", "tf32", AUTO)  # what `flashflex plan --dtype` accepts


@dataclass(frozen=True)
class DtypeTrial:
    """One dtype planned: the plan (None with the error that stopped it), its predicted tokens/s on the
    whole cluster, its cost per million tokens (None without prices), and whatever the caller keeps with it."""

    dtype: str
    plan: Plan | None
    tokens_per_s: float = 0.0
    per_million_tokens: float | None = None
    error: FlashflexError | None = None
    payload: object = None


PlanDtype = Callable[[str], DtypeTrial]  # plans the fleet in one dtype; raises a FlashflexError when nothing fits


def lacking_types(cluster: Cluster, devices: Sequence[str], dtype: str) -> list[str]:
    """Device types among `devices` that lack `dtype` (compute it on their fp32 units), sorted."""
    return sorted({cluster.device(d).type for d in devices if cluster.device(d).compute_dtype(dtype) != dtype})


def _runs(trial: DtypeTrial) -> bool:
    return trial.plan is not None and math.isfinite(trial.tokens_per_s) and trial.tokens_per_s > 0


def _better(a: DtypeTrial, b: DtypeTrial, objective: str) -> bool:
    """True when `a` beats `b` strictly (a tie keeps the earlier, preferred dtype)."""
    if not _runs(b):
        return _runs(a)
    if not _runs(a):
        return False
    if objective == "cost" and a.per_million_tokens is not None and b.per_million_tokens is not None:
        return a.per_million_tokens < b.per_million_tokens
    return a.tokens_per_s > b.tokens_per_s


def _figure(trial: DtypeTrial, objective: str, currency: str) -> str:
    if not _runs(trial):
        return f"{trial.dtype}: no plan ({trial.error or 'the plan found does not fit'})"
    if objective == "cost" and trial.per_million_tokens is not None:
        money = f"{currency} " if currency else ""
        return f"{trial.dtype}: {money}{trial.per_million_tokens:.4g} per million tokens"
    return f"{trial.dtype}: {trial.tokens_per_s:,.0f} tokens/s"


def _fate(cluster: Cluster, trial: DtypeTrial) -> str:
    """How the bf16 plan treats the devices that lack bf16: used at their fp32 rate, or left idle."""
    if trial.plan is None:
        return ""
    used = lacking_types(cluster, [r.device for r in trial.plan.ranks()], trial.dtype)
    return ("the bf16 plan uses them at no more than their fp32 rate" if used
            else "the bf16 plan leaves them idle")


def choose_dtype(cluster: Cluster, devices: Sequence[str], plan_dtype: PlanDtype, objective: str = "throughput",
                 currency: str = "") -> tuple[DtypeTrial, str]:
    """The chosen trial and the reason, for a fleet of `devices` (those the planner may use; module docstring).
    Raises the bf16 attempt's error when neither dtype can be planned."""
    lacking = lacking_types(cluster, devices, "bf16")
    if not lacking:
        return plan_dtype("bf16"), "every device computes bf16 natively"
    trials = [_attempt(plan_dtype, dtype) for dtype in AUTO_DTYPES]
    best = trials[0]
    for trial in trials[1:]:
        if _better(trial, best, objective):
            best = trial
    if not _runs(best) and trials[0].error is not None:
        raise trials[0].error
    others = [t for t in trials if t is not best]
    names = ", ".join(lacking)
    fate = _fate(cluster, trials[0])
    reason = (f"{names} lack{'s' if len(lacking) == 1 else ''} bf16{': ' + fate if fate else ''}; "
              f"{_figure(best, objective, currency)}, " + ", ".join(_figure(t, objective, currency) for t in others))
    return best, reason


def _attempt(plan_dtype: PlanDtype, dtype: str) -> DtypeTrial:
    try:
        return plan_dtype(dtype)
    except FlashflexError as exc:
        return DtypeTrial(dtype, None, error=exc)

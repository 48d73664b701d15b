"""Validate a plan against a cluster and predict it afresh: the format's checks, then the cost model.

Used by `show`, `diff` and the benchmarks; the plan format itself (plan/) imports nothing of the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hardware.cluster import Cluster
from ..plan.schema import Plan
from ..plan.validate import check_plan
from .estimate import Estimate, estimate
from .params import CostParams


@dataclass
class Checked:
    """Errors (the plan cannot run on this cluster), warnings, and the fresh estimate (None on errors that
    make estimating impossible, such as unknown devices)."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    estimate: Estimate | None = None

    @property
    def ok(self) -> bool:
        """True when there is no error."""
        return not self.errors


def validate_plan(plan: Plan, cluster: Cluster, params: CostParams | None = None) -> Checked:
    """Check `plan` against `cluster`, then estimate it; a stage that does not fit is an error."""
    found = check_plan(plan, cluster)
    out = Checked(list(found.errors), list(found.warnings))
    if out.errors:
        return out
    est = estimate(plan, cluster, params)
    out.estimate = est
    for problem in est.problems:
        out.errors.append(f"out of memory: {problem}")
    out.warnings.extend(unmatched_profiles(est, params))
    for st in est.stages:
        if st.extrapolated:
            out.warnings.append(f"pipelines.{st.pipeline}.stages.{st.stage}: its layer profile was extrapolated "
                                "beyond the measured micro-batch sizes or TP degrees (a + b * mbs fit)")
    return out


def unmatched_profiles(est: Estimate, params: CostParams | None) -> list[str]:
    """One warning per layer profile of `params` that costed no stage of `est`."""
    used = set(est.profiles_used())
    out = []
    for profile in (params or CostParams()).layer_profiles:
        if profile.sha256() not in used:
            paths = profile.paths()
            out.append(
                f"the layer profile of {profile.device_type} ({'compiled' if paths.compile else 'eager'}, "
                f"{'chunked' if paths.chunked_loss else 'whole-vocabulary'} loss) matched no stage: a stage uses a "
                "profile of its device type, shape, settings and runtime paths (the launch defaults: compiled on "
                "GPUs, chunked loss); re-measure with flashflex profile --model on those paths")
    return out


def reestimated(plan: Plan, est: Estimate) -> Plan:
    """`plan` with `predicted` replaced by a fresh estimate and `inputs.layer_profiles` by the profiles it
    used (absent when none)."""
    inputs = plan.inputs.model_copy(update={"layer_profiles": est.profiles_used() or None})
    return plan.model_copy(update={"predicted": est.prediction(), "inputs": inputs})

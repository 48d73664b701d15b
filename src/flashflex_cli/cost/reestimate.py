"""Validate a plan against a cluster and predict it afresh: the format's checks, then the cost model.

Used by `show`, `diff` and the benchmarks; the plan format itself (plan/) imports nothing of the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hardware.cluster import Cluster
from ..layers.schema import LayerProfile
from ..plan.schema import Plan
from ..plan.validate import check_plan
from ..semantics.runtime_paths import RuntimeOptions, switch_flag
from .estimate import Estimate, estimate
from .measured import device_type_key
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
    out.warnings.extend(unmatched_profiles(est, params, cluster))
    for st in est.stages:
        if st.extrapolated:
            out.warnings.append(f"pipelines.{st.pipeline}.stages.{st.stage}: its layer profile was extrapolated "
                                "beyond the measured micro-batch sizes or TP degrees (a + b * mbs fit)")
    return out


def unmatched_profiles(est: Estimate, params: CostParams | None, cluster: Cluster) -> list[str]:
    """One line per layer profile of `params` that costed no stage of `est` on `cluster`, naming why: the runtime
    path it was measured on that differs from the launch's (the switch that would match it), or no stage of its
    device type."""
    params = params or CostParams()
    used = set(est.profiles_used())
    out = []
    for profile in params.layer_profiles:
        if profile.sha256() in used:
            continue
        paths = profile.paths()
        head = (f"the layer profile of {profile.device_type} ({'compiled' if paths.compile else 'eager'}, "
                f"{'chunked' if paths.chunked_loss else 'whole-vocabulary'} loss) matched no stage")
        out.append(f"{head}: {_why_unmatched(profile, est, params, cluster)}")
    return out


def _why_unmatched(profile: LayerProfile, est: Estimate, params: CostParams, cluster: Cluster) -> str:
    """Why `profile` costed no stage: the first runtime path of a stage of its device type that differs from the
    profile's, else that no stage runs on its type alone."""
    wanted = device_type_key(profile.device_type)
    measured = profile.paths()
    runs_on: list[RuntimeOptions] = []
    for st in est.stages:
        if any(device_type_key(cluster.device(d).type) == wanted for d in st.devices):
            runs_on.append(params.runtime.resolved(st.on_cuda))
    if not runs_on:
        return f"no stage runs on {profile.device_type}"
    for launch in runs_on:
        for name in ("compile", "chunked_loss"):
            if getattr(measured, name) != getattr(launch, name):
                return (f"it was measured with {switch_flag(name, getattr(measured, name))}, the launch predicted "
                        f"takes {switch_flag(name, getattr(launch, name))} (give {switch_flag(name, getattr(measured, name))} "
                        "to predict a launch on its paths, or re-measure with flashflex profile --model on these)")
    return (f"every stage running on {profile.device_type} also runs on a device type without a matching layer "
            "profile")


def reestimated(plan: Plan, est: Estimate) -> Plan:
    """`plan` with `predicted` replaced by a fresh estimate and `inputs.layer_profiles` by the profiles it
    used (absent when none)."""
    inputs = plan.inputs.model_copy(update={"layer_profiles": est.profiles_used() or None})
    return plan.model_copy(update={"predicted": est.prediction(), "inputs": inputs})

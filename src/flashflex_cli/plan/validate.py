"""Check a plan against a cluster (and the model it names) and re-estimate it with the cost model.

Plans are edited by hand, so nothing in them is trusted: every device must exist in the cluster, the
cluster's hash should match the one the plan was made for (a mismatch is a warning: a re-profiled
cluster is still the same machine), every stage must fit in its devices' memory per the cost model, and
every device of the cluster should be either used or listed as unused (a warning otherwise).
Structural rules (contiguous layers, TP dividing the heads, a micro-batch per stage) are enforced when
the plan is loaded (`plan/schema.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cost.estimate import Estimate, estimate
from ..cost.params import CostParams
from ..hardware.cluster import Cluster
from .schema import Plan


@dataclass
class Validation:
    """Errors (the plan cannot run on this cluster), warnings, and the fresh estimate (None on errors
    that make estimating impossible, such as unknown devices)."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    estimate: Estimate | None = None

    @property
    def ok(self) -> bool:
        """True when there is no error."""
        return not self.errors


def validate_plan(plan: Plan, cluster: Cluster, params: CostParams | None = None) -> Validation:
    """Validate `plan` against `cluster` and re-estimate it (module docstring)."""
    out = Validation()
    known = set(cluster.device_ids)
    used = [rank.device for rank in plan.ranks()]
    missing = [d for d in used if d not in known]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        out.errors.append(f"the plan uses {len(missing)} device(s) cluster {cluster.name!r} does not have: {shown}")
    if plan.world_size > len(known):
        out.errors.append(f"the plan needs {plan.world_size} devices, cluster {cluster.name!r} has {len(known)}")
    unknown_unused = [u.device for u in plan.unused_devices if u.device not in known]
    if unknown_unused:
        out.warnings.append(f"unused_devices names device(s) not in the cluster: {', '.join(unknown_unused[:5])}")
    if plan.inputs.cluster_sha256 != cluster.sha256():
        out.warnings.append(
            f"the plan was made for cluster {plan.inputs.cluster_name or '?'} "
            f"(sha256 {plan.inputs.cluster_sha256[:12]}), this cluster {cluster.name!r} has sha256 "
            f"{cluster.sha256()[:12]}; predictions below are for this cluster"
        )
    if out.errors:
        return out
    listed = set(used) | {u.device for u in plan.unused_devices}
    idle = [d for d in cluster.device_ids if d not in listed]
    if idle:
        out.warnings.append(f"{len(idle)} device(s) of the cluster are neither used nor listed as unused: "
                            f"{', '.join(idle[:5])}")
    est = estimate(plan, cluster, params)
    out.estimate = est
    for problem in est.problems:
        out.errors.append(f"out of memory: {problem}")
    return out


def reestimated(plan: Plan, est: Estimate) -> Plan:
    """`plan` with `predicted` replaced by a fresh estimate."""
    return plan.model_copy(update={"predicted": est.to_predicted()})

"""Check a plan against a cluster, as a format: nothing here estimates (cost/reestimate.py does).

Plans are edited by hand, so nothing in them is trusted: every device must exist in the cluster, the
cluster's hash should match the one the plan was made for (a mismatch is a warning: a re-profiled
cluster is still the same machine), and every device of the cluster should be either used or listed as
unused (a warning otherwise). A device type the catalog does not know is warned about where its cluster file is
read (commands/cluster_input.py). Structural rules (contiguous layers, TP dividing the heads) are enforced
when the plan is loaded (`plan/schema.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..hardware.cluster import Cluster
from .schema import Plan


@dataclass
class Validation:
    """Errors (the plan cannot run on this cluster) and warnings."""

    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when there is no error."""
        return not self.errors


def check_plan(plan: Plan, cluster: Cluster) -> Validation:
    """Check `plan` against `cluster` (module docstring)."""
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
    short = [p for p, pipe in enumerate(plan.pipelines) if pipe.num_micro_batches < len(pipe.stages)]
    if short:
        out.warnings.append(f"pipeline(s) {', '.join(map(str, short))} have fewer micro-batches than stages: "
                            "1F1B cannot fill them and most of their devices idle")
    return out

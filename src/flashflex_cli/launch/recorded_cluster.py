"""The cluster file a plan records (`inputs.cluster_path`), for `flashflex launch PLAN` without --cluster.

The path is the one `flashflex plan` was given: relative paths are tried from the current folder, then from
the plan file's folder. Its sha256 is checked afterwards as for an explicit --cluster (preflight).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..plan.schema import load_plan


def recorded_cluster_path(plan_path: Path) -> Path:
    """The cluster file recorded in the plan at `plan_path`; InputError when there is none or it is gone."""
    recorded = load_plan(plan_path).inputs.cluster_path
    if not recorded:
        raise InputError(f"{plan_path} records no cluster file (a plan made before flashflex recorded it, or by "
                         "hand): pass --cluster")
    candidates = [Path(recorded)]
    if not Path(recorded).is_absolute():
        candidates.append(plan_path.parent / recorded)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise InputError(f"{plan_path} was made for cluster file {recorded!r}, which is not there (looked in the "
                     f"current folder and next to the plan): pass --cluster")

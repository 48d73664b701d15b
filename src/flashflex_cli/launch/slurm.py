"""Render a plan as an sbatch script from a `launchers/` template: `srun torchrun ...` once per node.

Two bundled templates: `slurm` (one allocation of N nodes; node i of the allocation runs plan node i)
and `slurm-hetjob` (a heterogeneous job, one component per plan node with its own CPU and GPU count,
for fleets whose nodes differ). The default is `slurm-hetjob` when nodes differ in process count or
device type, else `slurm`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..hardware.cluster import Cluster
from ..plan.schema import Plan
from ..run_config import RunConfig
from .layout import NodeLayout, node_layouts
from .templates import find_template, plain_text, render, sbatch_word
from .torchrun import RenderSettings, global_values, node_values


@dataclass(frozen=True)
class SlurmSettings:
    """sbatch resources: job name, log path (SLURM patterns allowed), CPUs per process, extra #SBATCH lines."""

    job_name: str = "flashflex"
    log: str = "flashflex-%j.out"
    cpus_per_process: int = 1
    sbatch_extra: tuple[str, ...] = ()


def _is_gpu(cluster: Cluster | None, device: str) -> bool:
    return cluster is not None and cluster.device(device).type.lower() not in ("cpu", "host")


def _device_types(cluster: Cluster | None, layout: NodeLayout) -> tuple[str, ...]:
    if cluster is None:
        return ()
    return tuple(sorted({cluster.device(d).type for d in layout.devices}))


def _sbatch_line(line: str) -> str:
    """An extra `#SBATCH ...` directive line, without control characters."""
    text = plain_text(line, "extra #SBATCH line")
    if not text.startswith("#SBATCH "):
        raise InputError(f"extra #SBATCH line {text!r} must start with '#SBATCH '")
    return text


def default_template(plan: Plan, cluster: Cluster | None) -> str:
    """`slurm-hetjob` when the nodes differ in process count or device type, else `slurm`."""
    layouts = node_layouts(plan, cluster)
    shapes = {(layout.nproc, _device_types(cluster, layout)) for layout in layouts}
    return "slurm-hetjob" if len(shapes) > 1 else "slurm"


def render_slurm(plan: Plan, cluster: Cluster | None, options: RunConfig, settings: RenderSettings,
                 slurm: SlurmSettings) -> str:
    """The sbatch script text."""
    layouts = node_layouts(plan, cluster, list(settings.hosts) if settings.hosts else None)
    template = find_template(settings.template or default_template(plan, cluster))
    values = global_values(plan, layouts, options, settings)
    gpus = [sum(_is_gpu(cluster, d) for d in layout.devices) for layout in layouts]
    extra = [_sbatch_line(line) for line in slurm.sbatch_extra]
    if max(gpus) > 0:
        extra.insert(0, f"#SBATCH --gres=gpu:{max(gpus)}")
    values.update({
        "job_name": sbatch_word(slurm.job_name, "--job-name"),
        "log": sbatch_word(slurm.log, "SLURM log path"),
        "cpus_per_task": max(layout.nproc for layout in layouts) * slurm.cpus_per_process,
        "sbatch_extra": "\n".join(extra),
    })
    per_node = node_values(layouts, options, settings)
    for i, (layout, entry) in enumerate(zip(layouts, per_node, strict=True)):
        node_sbatch = f" --gres=gpu:{gpus[i]}" if gpus[i] else ""
        if settings.hosts is None and cluster is not None:
            hostname = next((n.hostname for n in cluster.nodes if n.name == layout.name), None)
            if hostname:
                node_sbatch += f" --nodelist={sbatch_word(hostname, f'hostname of node {layout.name}')}"
        entry.update({
            "cpus": layout.nproc * slurm.cpus_per_process,
            "node_sbatch": node_sbatch,
            "hetjob_separator": "#SBATCH hetjob\n" if i else "",
        })
    return render(template, values, per_node)

"""Render a plan as one `torchrun` command line per host (c10d rendezvous; hosts may differ in size)."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from ..hardware.cluster import Cluster
from ..plan.schema import Plan
from .layout import NodeLayout, node_layouts
from .options import RunOptions
from .templates import find_template, render


@dataclass(frozen=True)
class RenderSettings:
    """How rendered commands reach the hosts.

    hosts: address of each used plan node, in layout order (default: cluster hostname or node name).
    port: rendezvous TCP port on the first host. ifnames: GLOO_SOCKET_IFNAME per host (one value for
    all, or one per host). torchrun: the torchrun executable. run_id: rendezvous id.
    """

    hosts: tuple[str, ...] | None = None
    port: int = 29500
    ifnames: tuple[str, ...] = ()
    torchrun: str = "torchrun"
    run_id: str = "flashflex"
    template: str | None = None


def _env_prefix(settings: RenderSettings, index: int) -> str:
    if not settings.ifnames:
        return ""
    name = settings.ifnames[index] if len(settings.ifnames) > 1 else settings.ifnames[0]
    return f"env GLOO_SOCKET_IFNAME={shlex.quote(name)} "


def node_values(layouts: list[NodeLayout], options: RunOptions, settings: RenderSettings) -> list[dict[str, object]]:
    """Per-node template fields: node, host, index, nproc, is_host, ranks, env, worker_args."""
    out = []
    for i, layout in enumerate(layouts):
        out.append({
            "node": layout.name,
            "host": layout.host,
            "index": i,
            "nproc": layout.nproc,
            "is_host": 1 if i == 0 else 0,
            "ranks": ",".join(str(r) for r in layout.ranks),
            "devices": ",".join(layout.devices),
            "env": _env_prefix(settings, i),
            "worker_args": options.worker_shell(),
        })
    return out


def global_values(plan: Plan, layouts: list[NodeLayout], options: RunOptions,
                  settings: RenderSettings) -> dict[str, object]:
    """Template fields shared by every node."""
    return {
        "plan": options.plan,
        "nnodes": len(layouts),
        "world_size": plan.world_size,
        "torchrun": settings.torchrun,
        "run_id": settings.run_id,
        "port": settings.port,
        "rdzv_endpoint": f"{layouts[0].host}:{settings.port}",
    }


def render_torchrun(plan: Plan, cluster: Cluster | None, options: RunOptions, settings: RenderSettings) -> str:
    """A shell script with one torchrun command line per host (comment lines name the host)."""
    layouts = node_layouts(plan, cluster, list(settings.hosts) if settings.hosts else None)
    template = find_template(settings.template or "torchrun")
    return render(template, global_values(plan, layouts, options, settings),
                  node_values(layouts, options, settings))


def command_lines(script: str) -> list[str]:
    """The command lines of a rendered torchrun script (everything but comments and blank lines)."""
    return [line for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def template_path(name: str | None) -> Path:
    """Resolve a template name or path (for messages)."""
    return find_template(name or "torchrun")

"""Render a plan as one `torchrun` command line per host (c10d rendezvous; hosts may differ in size).

Each line starts the workers with `--config RUN/config.json --plan-node NODE`: the run configuration
(run_config.py) is saved by `flashflex launch` when it renders, and every host must read it, the plan and the
cluster at the paths it names (a shared folder, or copies at the same paths).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..hardware.cluster import Cluster
from ..hostnames import url_host
from ..plan.schema import Plan
from ..run_config import RunConfig
from ..validate_numbers import port
from .layout import NodeLayout, node_layouts
from .options import ALLOC_CONF_SHELL, FLIGHT_RECORDER_SHELL, worker_argv
from .templates import find_template, plain_text, render, shell_join, shell_word


@dataclass(frozen=True)
class RenderSettings:
    """How rendered commands reach the hosts.

    hosts: address of each used plan node, in layout order (default: cluster hostname or node name).
    port: rendezvous TCP port on the first host. ifnames: the network interface of gloo and NCCL
    (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) per host (one value for all, or one per host). torchrun: the torchrun executable. run_id: rendezvous id.
    """

    hosts: tuple[str, ...] | None = None
    port: int = 29500
    ifnames: tuple[str, ...] = ()
    torchrun: str = "torchrun"
    run_id: str = "flashflex"
    template: str | None = None
    elastic: ElasticRender | None = None


@dataclass(frozen=True)
class ElasticRender:
    """An elastic rendering (launchers/torchrun-elastic.sh.tmpl): torch elastic restarts with a rendezvous of
    min_nodes..all hosts; last_call_s: seconds the rendezvous waits for late hosts once min_nodes joined."""

    max_restarts: int = 3
    min_nodes: int = 1
    last_call_s: int = 5


def _env_prefix(settings: RenderSettings, index: int) -> str:
    """`env` with the workers' variables: the allocator setting and NCCL's flight recorder (fixed texts, expanded
    by the shell that runs the line, so values set there win), and where --ifname names an interface both
    backends' socket interface: GLOO_SOCKET_IFNAME (an exact name) and NCCL_SOCKET_IFNAME (NCCL reads a bare
    name as a prefix of interface names; a leading "=" makes it the exact name, the same interface as gloo's)."""
    words = ["env", ALLOC_CONF_SHELL, FLIGHT_RECORDER_SHELL]
    if settings.ifnames:
        name = settings.ifnames[index] if len(settings.ifnames) > 1 else settings.ifnames[0]
        words.append(f"GLOO_SOCKET_IFNAME={shell_word(name, '--ifname')}")
        words.append(f"NCCL_SOCKET_IFNAME={shell_word('=' + name, '--ifname')}")
    return " ".join(words) + " "


def check_settings(settings: RenderSettings, nodes: int) -> None:
    """The port is a TCP port; --ifname names one interface for all hosts or one per host."""
    port(settings.port)
    if len(settings.ifnames) not in (0, 1, nodes):
        raise InputError(f"--ifname names {len(settings.ifnames)} interfaces, expected one for all hosts or one "
                         f"per host ({nodes})")


def node_values(layouts: list[NodeLayout], options: RunConfig, settings: RenderSettings) -> list[dict[str, object]]:
    """Per-node template fields, each a shell word: node, host, index, nproc, is_host, ranks, devices, env,
    worker_args (`--config RUN/config.json`: the template adds `--plan-node {{ node }}`)."""
    check_settings(settings, len(layouts))
    worker_args = shell_join(worker_argv(options.path), "worker argument")
    out = []
    for i, layout in enumerate(layouts):
        out.append({
            "node": shell_word(layout.name, "plan node"),
            "host": shell_word(layout.host, "host"),
            "index": i,
            "nproc": layout.nproc,
            "is_host": 1 if i == 0 else 0,
            "ranks": ",".join(str(r) for r in layout.ranks),
            "devices": shell_word(",".join(layout.devices), "plan devices"),
            "env": _env_prefix(settings, i),
            "worker_args": worker_args,
        })
    return out


def global_values(plan: Plan, layouts: list[NodeLayout], options: RunConfig,
                  settings: RenderSettings) -> dict[str, object]:
    """Template fields shared by every node, each a shell word."""
    check_settings(settings, len(layouts))
    return {
        "plan": shell_word(options.plan, "plan path"),
        "nnodes": len(layouts),
        "world_size": plan.world_size,
        "torchrun": shell_word(settings.torchrun, "--torchrun"),
        "run_id": shell_word(settings.run_id, "--run-id"),
        "port": settings.port,
        "rdzv_endpoint": shell_word(f"{url_host(plain_text(layouts[0].host, 'host'))}:{settings.port}", "host"),
    }


def render_torchrun(plan: Plan, cluster: Cluster | None, options: RunConfig, settings: RenderSettings) -> str:
    """A shell script with one torchrun command line per host (comment lines name the host)."""
    layouts = node_layouts(plan, cluster, list(settings.hosts) if settings.hosts else None)
    elastic = settings.elastic
    template = find_template(settings.template or ("torchrun-elastic" if elastic else "torchrun"))
    values = global_values(plan, layouts, options, settings)
    if elastic is not None:
        values.update(nnodes_range=f"{min(elastic.min_nodes, len(layouts))}:{len(layouts)}",
                      max_restarts=elastic.max_restarts, last_call_s=elastic.last_call_s)
    return render(template, values, node_values(layouts, options, settings))


def command_lines(script: str) -> list[str]:
    """The command lines of a rendered torchrun script (everything but comments and blank lines)."""
    return [line for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def template_path(name: str | None) -> Path:
    """Resolve a template name or path (for messages)."""
    return find_template(name or "torchrun")

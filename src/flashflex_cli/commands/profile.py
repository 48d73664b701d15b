"""CLI commands: `flashflex profile` (synthetic, local probe, distributed probe) and `profile merge`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..errors import InputError
from ..hardware.catalog import GIB
from ..hardware.cluster import Cluster, load_cluster, save_cluster

profile_app = typer.Typer(
    help="Describe the hardware as a cluster file (flashflex.cluster/1).",
    no_args_is_help=False,
    add_completion=False,
)


def _stderr() -> Console:
    return Console(stderr=True)


def _fmt_rate(bytes_per_s: float, bits: bool = False) -> str:
    """bytes/s -> a short human figure: Gbit/s (how NICs are sold) or GB/s (memory, intra-node links)."""
    if bits:
        return f"{bytes_per_s * 8 / 1e9:.3g} Gbit/s"
    return f"{bytes_per_s / 1e9:.3g} GB/s"


def render_summary(cluster: Cluster, console: Console | None = None) -> None:
    """A rich table of the cluster on stderr: per node devices, memory, TFLOP/s, links."""
    console = console or _stderr()
    table = Table(title=f"cluster {cluster.name}: {len(cluster.device_ids)} devices on {len(cluster.nodes)} nodes")
    for column in ("node", "devices", "memory", "TFLOP/s (bf16)", "slowdown", "intra", "nic"):
        table.add_column(column)
    for node in cluster.nodes:
        types = sorted({d.type for d in node.devices})
        flops = sorted({round(d.flops("bf16") / 1e12, 3) for d in node.devices})
        factors = [f"{d.slowdown:g}" for d in node.devices]
        slowdown = factors[0] if len(set(factors)) == 1 else ",".join(factors)
        intra = node.intra_link.kind
        if node.intra_link.bandwidth:
            intra += f" {_fmt_rate(node.intra_link.bandwidth)}"
        nic = node.nic + (f" {_fmt_rate(node.nic_bandwidth, bits=True)}" if node.nic_bandwidth else "")
        table.add_row(
            node.name,
            f"{len(node.devices)} x {'/'.join(types)}",
            f"{node.devices[0].memory_bytes / GIB:.1f} GiB",
            "/".join(f"{f:g}" for f in flops),
            slowdown,
            intra,
            nic,
        )
    console.print(table)
    for pair in cluster.inter_node.pairs:
        latency = f", latency {pair.latency_s * 1e6:.0f} us" if pair.latency_s else ""
        console.print(f"  {pair.a} <-> {pair.b}: {_fmt_rate(pair.bandwidth, bits=True)} (measured{latency})")


@profile_app.callback(invoke_without_command=True)
def profile(
    ctx: typer.Context,
    out: Path | None = typer.Option(None, "--out", "-o", help="Cluster file to write (atomically)."),
    synthetic: str | None = typer.Option(
        None, "--synthetic", "-s", metavar="SPEC",
        help="Build from the catalog, e.g. '1x8xA100-80G-SXM:nic=ib,3x8x4090:nic=eth:bw=10' or "
        "'1x4xcpu:slowdown=1,1,2,4'. Options per group: nic=, bw= (Gbit/s), slowdown=, link=, name=.",
    ),
    name: str | None = typer.Option(None, "--name", help="Cluster name (default: the output file's stem)."),
    description: str | None = typer.Option(None, "--description", help="Free-text cluster description."),
    quick: bool = typer.Option(False, "--quick", help="Small, fast probes (tests, smoke checks)."),
    cpu_devices: int = typer.Option(1, "--cpu-devices", min=1, help="Emulated devices on a CPU-only host."),
    distributed: bool = typer.Option(
        False, "--distributed", help="Run under torchrun, one process per node: probe every node and "
        "every node pair; rank 0 writes one merged file."),
    node_name: str | None = typer.Option(None, "--node-name", help="This node's name (default: hostname)."),
    nic: str = typer.Option("eth", "--nic", help="NIC class recorded for a probed node: ib, roce or eth."),
) -> None:
    """Write a cluster profile: synthetic from the catalog, or measured on this machine (or fleet)."""
    if ctx.invoked_subcommand is not None:
        return
    if out is None:
        raise InputError("flashflex profile: --out FILE is required")
    cluster_name = name or out.stem
    if synthetic is not None:
        if distributed:
            raise InputError("--synthetic and --distributed cannot be combined")
        from ..hardware.synthetic import build_cluster

        cluster = build_cluster(synthetic, name=cluster_name, description=description)
    elif distributed:
        from ..hardware.probe_network import profile_distributed

        cluster = profile_distributed(
            quick=quick, cpu_devices=cpu_devices, node_name=node_name, nic=nic,
            name=cluster_name, description=description,
        )
        if cluster is None:  # not rank 0: rank 0 writes the merged file
            return
    else:
        from ..hardware.merge import cluster_of_nodes
        from ..hardware.probe_local import profile_node

        node = profile_node(quick=quick, cpu_devices=cpu_devices, node_name=node_name, nic=nic, progress=True)
        cluster = cluster_of_nodes([node], name=cluster_name, description=description)
    save_cluster(out, cluster)
    render_summary(cluster)
    _stderr().print(f"wrote {out}")


@profile_app.command("merge")
def merge(
    files: list[Path] = typer.Argument(..., help="Cluster files to merge (node names must differ)."),
    out: Path = typer.Option(..., "--out", "-o", help="Merged cluster file to write."),
    name: str | None = typer.Option(None, "--name", help="Cluster name (default: the output file's stem)."),
    description: str | None = typer.Option(None, "--description", help="Free-text cluster description."),
) -> None:
    """Merge per-node cluster files into one cluster file."""
    from ..hardware.merge import merge_clusters

    clusters = [load_cluster(path) for path in files]
    merged = merge_clusters(clusters, name=name or out.stem, description=description,
                            sources=[str(p) for p in files])
    save_cluster(out, merged)
    render_summary(merged)
    _stderr().print(f"wrote {out}")


def register(app: typer.Typer) -> None:
    """Add `profile` (and `profile merge`) to the root app."""
    app.add_typer(profile_app, name="profile")

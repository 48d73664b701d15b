"""CLI commands: `flashflex profile` (synthetic, local probe, distributed probe), `profile --model` (measured
per-layer costs, flashflex.layers/1) and `profile merge`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..errors import InputError
from ..fileio import check_writable_output, refuse_same_path
from ..hardware.cluster import Cluster, load_cluster, save_cluster
from ..units import byte_size
from ..validate_numbers import MAX_DEVICES_PER_NODE, int_in_range
from .consoles import diagnostics, results, wrote

profile_app = typer.Typer(
    help="Describe the hardware as a cluster file (flashflex.cluster/1).",
    no_args_is_help=False,
    add_completion=False,
)


def _fmt_rate(bytes_per_s: float, bits: bool = False) -> str:
    """bytes/s -> a short human figure: Gbit/s (how NICs are sold) or GB/s (memory, intra-node links)."""
    if bits:
        return f"{bytes_per_s * 8 / 1e9:.3g} Gbit/s"
    return f"{bytes_per_s / 1e9:.3g} GB/s"


def render_summary(cluster: Cluster, console: Console | None = None) -> None:
    """A rich table of the cluster (on stdout by default): per node devices, memory, TFLOP/s, links."""
    console = console or results()
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
            byte_size(node.devices[0].memory_bytes),
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
    slowdown: float = typer.Option(
        1.0, "--slowdown", help="Probed CPU devices emulate devices this many times slower (recorded per node)."),
    model: str | None = typer.Option(
        None, "--model", "-m", help="Measure one layer, the embedding and the head of this model (a preset or a "
        "config.json) and write a layer profile (flashflex.layers/1) instead of a cluster file."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="With --model: sequence length (tokens)."),
    micro_batch: str = typer.Option("1", "--micro-batch", help="With --model: micro-batch sizes, e.g. 1,2,4,8."),
    tp: str = typer.Option("1", "--tp", help="With --model: TP degrees, e.g. 1,2 (a TP group inside this node)."),
    dtype: str | None = typer.Option(
        None, "--dtype", help="With --model: bf16, fp16, fp32 or tf32 (default bf16 on GPU, fp32 on CPU)."),
    attention: str = typer.Option("sdpa", "--attention", help="With --model: flash, sdpa or eager."),
    recompute: bool = typer.Option(False, "--recompute", help="With --model: recompute layer activations."),
    repeats: int = typer.Option(5, "--repeats", help="With --model: timed runs per part (the median is kept)."),
    warmup: int = typer.Option(2, "--warmup", help="With --model: untimed runs per part before the timed ones."),
    compile_: bool | None = typer.Option(None, "--compile/--no-compile", help="With --model: measure the parts "
                                         "torch.compile'd as a run compiles them (default: on for GPUs, off on "
                                         "CPU)."),
) -> None:
    """Write a cluster profile: synthetic from the catalog, or measured on this machine (or fleet); with
    --model, a layer profile measured on this machine."""
    if ctx.invoked_subcommand is not None:
        return
    if out is None:
        raise InputError("flashflex profile: --out FILE is required")
    if model is not None:
        if synthetic is not None or distributed:
            raise InputError("--model cannot be combined with --synthetic or --distributed")
        request = LayerRequest(model, seq_len, micro_batch, tp, dtype, attention, recompute, repeats, warmup,
                               compile_)
        profile_layers(request, out)
        return
    if seq_len is not None or compile_ is not None:
        raise InputError("--seq-len, --compile (and the other layer options) need --model")
    check_writable_output(out)
    int_in_range(cpu_devices, "--cpu-devices", 1, MAX_DEVICES_PER_NODE)
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
            name=cluster_name, description=description, slowdown=slowdown,
        )
        if cluster is None:  # not rank 0: rank 0 writes the merged file
            return
    else:
        from ..hardware.merge import cluster_of_nodes
        from ..hardware.probe_local import profile_node

        node = profile_node(quick=quick, cpu_devices=cpu_devices, node_name=node_name, nic=nic, progress=True,
                            slowdown=slowdown)
        cluster = cluster_of_nodes([node], name=cluster_name, description=description)
    save_cluster(out, cluster)
    render_summary(cluster)
    wrote(results(), out)


@dataclass(frozen=True)
class LayerRequest:
    """The raw `profile --model` options, as typed (lists as comma-separated text)."""

    model: str
    seq_len: int | None
    micro_batch: str
    tp: str
    dtype: str | None
    attention: str
    recompute: bool
    repeats: int
    warmup: int
    compile: bool | None = None


def parse_int_list(text: str, option: str) -> tuple[int, ...]:
    """"1,2,4" -> (1, 2, 4): positive integers, no empty items, no repeats (InputError otherwise)."""
    values: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise InputError(f"{option} expects positive integers separated by commas, got {text!r}")
        if int(item) in values:
            raise InputError(f"{option} lists {int(item)} twice")
        values.append(int(item))
    return tuple(values)


def _check_out(out: Path, model: str) -> None:
    """Refuse an --out that cannot be written (a folder, ...) or that is the model's own config file."""
    check_writable_output(out)
    refuse_same_path(out, [model] if Path(model).exists() else [])


def layer_config(request: LayerRequest, kind: str):  # noqa: ANN202 - a BenchConfig (lazy torch import)
    from ..model.hf_config import resolve_model
    from ..profiler.layer_bench import BenchConfig
    from ..semantics.runtime_paths import RuntimeOptions

    spec = resolve_model(request.model)
    if request.seq_len is None:
        raise InputError("--model needs --seq-len")
    dtype = request.dtype or ("bf16" if kind == "cuda" else "fp32")
    return BenchConfig(spec=spec, seq_len=request.seq_len,
                       micro_batches=parse_int_list(request.micro_batch, "--micro-batch"), dtype=dtype,
                       attention=request.attention, recompute=request.recompute, repeats=request.repeats,
                       warmup=request.warmup, runtime=RuntimeOptions(compile=request.compile))


def _device_type(kind: str) -> str:
    """"cpu", or the catalog name of GPU 0 (its reported name, cleaned, when the catalog lacks it)."""
    if kind != "cuda":
        return "cpu"
    import torch

    from ..hardware.probe_local import catalog_match, default_node_name, gpu_memory_bytes

    name = torch.cuda.get_device_name(0)
    return catalog_match(name, gpu_memory_bytes(0)) or default_node_name(name)


def _source_line() -> str:
    import datetime
    import socket

    import torch

    return f"flashflex profile --model, torch {torch.__version__}, {datetime.date.today().isoformat()}, " \
           f"{socket.gethostname()}"


def profile_layers(request: LayerRequest, out: Path) -> None:
    """`flashflex profile --model`: check everything, measure, write the layer profile atomically."""
    from ..errors import InfeasibleError
    from ..layers.schema import save_layer_profile
    from ..profiler.layer_bench import build_profile, check_request, devices_available, measure

    _check_out(out, request.model)
    kind, count = devices_available()
    config = layer_config(request, kind)
    tps = parse_int_list(request.tp, "--tp")
    check_request(config, tps, kind, count)
    console = results()

    def report(skip) -> None:  # noqa: ANN001 - a layer_bench.Skipped
        diagnostics().print(f"skipped micro-batch {skip.micro_batch_size} at tp {skip.tp}: {skip.reason}")

    entries, _skipped = measure(config, tps, kind, progress=True, on_skip=report)
    if not entries:
        raise InfeasibleError("every micro-batch size was skipped (out of memory); nothing written")
    profile = build_profile(config, entries, _device_type(kind), _source_line())
    save_layer_profile(out, profile)
    wrote(console, out, f": {len(profile.entries)} entries, {config.spec.name}, seq_len {config.seq_len}, "
                        f"{config.dtype}, attention {config.attention}")


@profile_app.command("merge")
def merge(
    files: list[Path] = typer.Argument(..., help="Cluster files to merge (node names must differ)."),
    out: Path = typer.Option(..., "--out", "-o", help="Merged cluster file to write."),
    name: str | None = typer.Option(None, "--name", help="Cluster name (default: the output file's stem)."),
    description: str | None = typer.Option(None, "--description", help="Free-text cluster description."),
) -> None:
    """Merge per-node cluster files into one cluster file."""
    from ..hardware.merge import merge_clusters

    check_writable_output(out)
    refuse_same_path(out, files)
    clusters = [load_cluster(path) for path in files]
    merged = merge_clusters(clusters, name=name or out.stem, description=description,
                            sources=[str(p) for p in files])
    save_cluster(out, merged)
    render_summary(merged)
    wrote(results(), out)


def register(app: typer.Typer) -> None:
    """Add `profile` (and `profile merge`) to the root app."""
    app.add_typer(profile_app, name="profile")

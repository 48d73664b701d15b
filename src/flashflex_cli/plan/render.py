"""Rich rendering of plans, baselines and diffs for humans (stderr); units for humans: GiB, ms, TFLOP/s."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from ..hardware.catalog import GIB
from .diff import PlanDiff
from .schema import Plan


def compact_devices(devices: list[str]) -> str:
    """"node0/0,node0/1,node0/2" -> "node0/0-2"; runs of consecutive indices per node."""
    out: list[str] = []
    node, run = None, []  # type: ignore[var-annotated]

    def flush() -> None:
        if node is None:
            return
        text = f"{run[0]}" if len(run) == 1 else f"{run[0]}-{run[-1]}"
        out.append(f"{node}/{text}")

    for device in devices:
        name, _, index = device.rpartition("/")
        value = int(index) if index.isdigit() else index
        if name == node and isinstance(value, int) and run and isinstance(run[-1], int) and value == run[-1] + 1:
            run.append(value)
            continue
        flush()
        node, run = name, [value]
    flush()
    return ",".join(out)


def summary_line(predicted: dict[str, Any] | None) -> str:
    """Predicted tokens/s, MFU and iteration time in one line."""
    if not predicted:
        return "no prediction"
    return (f"{predicted['tokens_per_s']:,.0f} tokens/s, MFU {predicted['mfu'] * 100:.1f}%, "
            f"iteration {predicted['iteration_time_s'] * 1e3:,.1f} ms"
            + ("" if predicted.get("fits", True) else ", DOES NOT FIT"))


def plan_table(plan: Plan, title: str | None = None) -> Table:
    """One row per stage: devices, TP, layers, micro-batches, busy time per iteration, memory need / capacity."""
    inputs = plan.inputs
    table = Table(title=title or f"{inputs.strategy} plan: {inputs.model.name} on {inputs.cluster_name or 'cluster'}",
                  title_justify="left")
    for name, justify in (("pipe", "right"), ("stage", "right"), ("devices", "left"), ("tp", "right"),
                          ("layers", "right"), ("micro-batches", "right"), ("busy ms", "right"),
                          ("memory GiB", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    stages = {(s["pipeline"], s["stage"]): s for s in (plan.predicted or {}).get("stages", [])}
    sources = any(str(s.get("source", "modelled")) != "modelled" for s in stages.values())
    if sources:  # a column only when some stage is measured; render_plan says "all modelled" otherwise
        table.add_column("costs", justify="left")
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            info = stages.get((p, s), {})
            memory = ""
            if "memory_bytes" in info:
                memory = f"{info['memory_bytes'] / GIB:.1f} / {info.get('memory_capacity_bytes', 0) / GIB:.1f}"
            table.add_row(str(p) if s == 0 else "", str(s), compact_devices(stage.devices), str(stage.tp),
                          f"{stage.layers[0]}-{stage.layers[1] - 1} ({stage.num_layers})",
                          f"{pipe.num_micro_batches}x{pipe.micro_batch_size}" if s == 0 else "",
                          f"{info['time_s'] * 1e3:,.1f}" if "time_s" in info else "", memory,
                          *((str(info.get("source", "modelled")),) if sources else ()))
    return table


def render_plan(console: Console, plan: Plan, title: str | None = None) -> None:
    """Print a plan: stage table, unused devices, predicted figures."""
    console.print(plan_table(plan, title))
    for unused in plan.unused_devices:
        console.print(f"  unused {unused.device}: {unused.reason}")
    train = plan.inputs.train
    console.print(f"  global batch {train.global_batch} x seq {train.seq_len} ({train.dtype}, {train.attention} attention"
                  f"{', recompute' if train.recompute else ''}), {plan.world_size} devices, "
                  f"{len(plan.pipelines)} pipelines")
    console.print(f"  predicted: {summary_line(plan.predicted)}")
    stages = (plan.predicted or {}).get("stages", [])
    if stages and all(str(s.get("source", "modelled")) == "modelled" for s in stages):
        console.print("  every stage modelled (analytic cost model: no layer profile matched)")
    elif plan.inputs.layer_profiles:
        console.print(f"  measured layer profiles used: {', '.join(sha[:12] for sha in plan.inputs.layer_profiles)}")
    for problem in (plan.predicted or {}).get("problems", []):
        console.print(f"  [red]problem[/red]: {problem}")


def render_baseline(console: Console, plan: Plan, baseline: Plan | None, reason: str = "") -> None:
    """One line each for the plan and the uniform baseline, and their tokens/s ratio."""
    console.print(f"  {plan.inputs.strategy:>9}: {summary_line(plan.predicted)}")
    if baseline is None:
        console.print(f"    uniform: {reason or 'no symmetric layout fits'}")
        return
    layout = f"{len(baseline.pipelines)}x{len(baseline.pipelines[0].stages)}x{baseline.pipelines[0].stages[0].tp}"
    console.print(f"    uniform: {summary_line(baseline.predicted)} (DP x PP x TP {layout})")
    a, b = (plan.predicted or {}).get("tokens_per_s"), (baseline.predicted or {}).get("tokens_per_s")
    if a and b:
        console.print(f"  ratio {plan.inputs.strategy} / uniform: {a / b:.2f}x tokens/s")


def render_diff(console: Console, diff: PlanDiff, name_a: str, name_b: str) -> None:
    """Structural changes, then a metric table."""
    console.print(f"diff {name_a} -> {name_b}")
    if not diff.changes:
        console.print("  no structural change")
    for line in diff.changes:
        console.print(f"  {line}")
    table = Table(title="predicted", title_justify="left")
    for name in ("metric", "A", "B", "change"):
        table.add_column(name, justify="right" if name != "metric" else "left")
    for m in diff.metrics:
        fmt = (lambda v: f"{v * 100:.2f}%") if m.name == "mfu" else (lambda v: f"{v:,.6g}")
        table.add_row(m.name, "-" if m.a is None else fmt(m.a), "-" if m.b is None else fmt(m.b),
                      "-" if m.pct is None else f"{m.pct:+.2f}%")
    console.print(table)

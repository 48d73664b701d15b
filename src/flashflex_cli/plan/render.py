"""Rich rendering of plans, baselines and diffs for humans; units for humans: GiB, ms, TFLOP/s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from ..hardware.catalog import GIB
from ..semantics.runtime_paths import non_default_flags
from ..semantics.stated_error import MEDIAN_STEP_ERROR, mfu_advice
from .diff import PlanDiff
from .outer_text import outer_sync_lines
from .predicted import Predicted, PredictedStage, as_predicted
from .schema import Plan
from .text import compact_devices, layer_text, sharding_text


def mfu_text(predicted: Predicted | Mapping[str, Any], used_devices: int | None = None) -> str:
    """MFU over the devices used and, when the prediction carries the cluster's peak, over every device of
    the cluster (the basis on which layouts using different device sets compare), both labelled."""
    predicted = as_predicted(predicted)
    mfu = predicted.mfu
    peak_used, peak_all = predicted.peak_flops_used, predicted.peak_flops_cluster
    if not peak_used or not peak_all:
        return f"MFU {mfu * 100:.1f}%"
    used = f"the {used_devices} devices used" if used_devices is not None else "the devices used"
    total = predicted.devices_cluster
    every = f"all {total} devices" if total is not None else "the whole cluster"
    return f"MFU {mfu * 100:.1f}% of {used}, {mfu * peak_used / peak_all * 100:.1f}% of {every}"


def dollars_text(predicted: Predicted | Mapping[str, Any]) -> str:
    """Cost per hour and per million tokens, over the devices used and over the whole cluster ("" when the
    prediction has no prices)."""
    predicted = as_predicted(predicted)
    money = predicted.dollars
    if money is None:
        return ""
    cur = money.currency

    def num(key: str, fmt: str) -> str:
        value = getattr(money, key)
        return "?" if value is None else format(value, fmt)

    return (f"{cur} {num('per_hour_used', ',.2f')}/h for the devices used ({num('per_hour_cluster', ',.2f')}/h "
            f"for all), {cur} {num('per_million_tokens_used', ',.4g')} per million tokens "
            f"({num('per_million_tokens_cluster', ',.4g')} charging all)")


def summary_line(predicted: Predicted | Mapping[str, Any] | None, used_devices: int | None = None) -> str:
    """Predicted tokens/s, MFU (both bases when known) and iteration time in one line, then dollars."""
    predicted = as_predicted(predicted)
    if predicted is None:
        return "no prediction"
    money = dollars_text(predicted)
    return (f"{predicted.tokens_per_s:,.0f} tokens/s, {mfu_text(predicted, used_devices)}, "
            f"iteration {predicted.iteration_time_s * 1e3:,.1f} ms"
            + ("" if predicted.fits_memory else ", DOES NOT FIT") + (f"; {money}" if money else ""))


def dp_line(predicted: Predicted | Mapping[str, Any] | None) -> str | None:
    """The DP gradient reduction in one line: the exposed part (what the iteration waits for after the slowest
    pipeline) first, then the busiest stage's whole reduction, most of it hidden behind the backward. None when
    no stage reduces anything (or the prediction predates per-stage DP figures)."""
    predicted = as_predicted(predicted)
    stages = _stages(predicted)
    busiest = max((float(s.dp_s or 0.0) for s in stages), default=0.0)
    if predicted is None or busiest <= 0 or predicted.dp_exposed_s is None:
        return None
    return (f"DP gradient reduction: {predicted.dp_exposed_s * 1e3:,.1f} ms exposed "
            f"(busiest stage reduces for {busiest * 1e3:,.1f} ms, overlapped with its backward)")


def unused_lines(plan: Plan) -> list[str]:
    """One line per distinct reason: the devices left idle for it (compacted, plan order) and the reason."""
    by_reason: dict[str, list[str]] = {}
    for unused in plan.unused_devices:
        by_reason.setdefault(unused.reason, []).append(unused.device)
    return [f"unused {compact_devices(devices)}: {reason}" for reason, devices in by_reason.items()]


def plan_table(plan: Plan, title: str | None = None) -> Table:
    """One row per stage: devices, TP, layers, micro-batches, busy time per iteration, memory need / capacity."""
    inputs = plan.inputs
    table = Table(title=title or f"{inputs.strategy} plan: {inputs.model.name} on {inputs.cluster_name or 'cluster'}",
                  title_justify="left")
    for name, justify in (("pipe", "right"), ("stage", "right"), ("devices", "left"), ("tp", "right"),
                          ("layers", "right"), ("micro-batches", "right"), ("busy ms", "right"),
                          ("memory GiB", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    stages = {(s.pipeline, s.stage): s for s in _stages(plan.predicted)}
    sources = any(_source(s) != "modelled" for s in stages.values())
    if sources:  # a column only when some stage is measured; render_plan says "all modelled" otherwise
        table.add_column("costs", justify="left")
    lacking = any(s.dtype_not_native_on for s in stages.values())
    if lacking:  # a column only when some stage computes in a dtype its devices lack; dtype_lines says why
        table.add_column("note", justify="left")
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            info = stages.get((p, s), PredictedStage(pipeline=p, stage=s))
            memory = ""
            if info.memory_bytes is not None:
                memory = f"{info.memory_bytes / GIB:.1f} / {(info.memory_capacity_bytes or 0) / GIB:.1f}"
            table.add_row(str(p) if s == 0 else "", str(s), compact_devices(stage.devices), str(stage.tp),
                          layer_text(stage.layers),
                          f"{pipe.num_micro_batches}x{pipe.micro_batch_size}" if s == 0 else "",
                          f"{info.time_s * 1e3:,.1f}" if info.time_s is not None else "", memory,
                          *((_source(info),) if sources else ()),
                          *((_lacking_note(inputs.train.dtype, info),) if lacking else ()))
    return table


def _lacking_note(dtype: str, stage: PredictedStage) -> str:
    """"no bf16" for a stage whose devices lack the training dtype (dtype_lines names them), else ""."""
    return f"no {dtype}" if stage.dtype_not_native_on else ""


def _stages(predicted: Predicted | None) -> list[PredictedStage]:
    """The prediction's stages (none without a prediction, or in one written without them)."""
    return list(predicted.stages or []) if predicted is not None else []


def _source(stage: PredictedStage) -> str:
    """Where the stage's times came from ("modelled" where the prediction does not say)."""
    return stage.source if stage.source is not None else "modelled"


def dtype_lines(plan: Plan) -> list[str]:
    """Why the plan computes in its dtype (`--dtype auto`'s reason) and, when some stages compute in a dtype
    their devices lack, how many, on which types, and what the prediction charges them."""
    train, out = plan.inputs.train, []
    if plan.inputs.dtype_reason:
        out.append(f"dtype {train.dtype} (chosen by --dtype auto): {plan.inputs.dtype_reason}")
    stages = [s for s in _stages(plan.predicted) if s.dtype_not_native_on]
    if stages:
        types = sorted({t for s in stages for t in s.dtype_not_native_on or []})
        measured = sum(1 for s in stages if _source(s) != "modelled")
        charged = "no more than their fp32 rate" + (f" ({measured} from a layer profile measured in "
                                                     f"{train.dtype})" if measured else "")
        out.append(f"{len(stages)} stage{'s' if len(stages) > 1 else ''} compute{'' if len(stages) > 1 else 's'} "
                   f"{train.dtype} on {', '.join(types)}, which lack{'' if len(types) > 1 else 's'} it "
                   f"(no {train.dtype} tensor cores): costed at {charged}")
    return out


def sharding_lines(plan: Plan) -> list[str]:
    """The optimizer-state lines of `plan` (none when it is not sharded)."""
    if plan.optimizer_sharding is None:
        return []
    out = [f"optimizer state: {sharding_text(plan)}"]
    if plan.optimizer_sharding.reason:
        out.append(f"  why: {plan.optimizer_sharding.reason}")
    return out


def render_plan(console: Console, plan: Plan, title: str | None = None) -> None:
    """Print a plan: stage table and its legend, unused devices, predicted figures."""
    console.print(plan_table(plan, title))
    console.print("  busy ms: a stage's compute and transfers per iteration; memory GiB: its predicted peak per device "
                  "(tensors as the runtime allocates them, the allocator's slack, a margin) / the device's memory",
                  markup=False, highlight=False, soft_wrap=True)
    for line in unused_lines(plan):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    train = plan.inputs.train
    console.print(f"  global batch {train.global_batch} x seq {train.seq_len} ({train.dtype}, {train.attention} attention"
                  f"{', recompute' if train.recompute else ''}), {plan.world_size} devices, "
                  f"{len(plan.pipelines)} pipelines")
    if flags := non_default_flags(plan.inputs.runtime_options()):
        console.print(f"  predicted for a launch with {' '.join(flags)} (flashflex launch takes them from the plan)",
                      markup=False, highlight=False, soft_wrap=True)
    for line in dtype_lines(plan) + outer_sync_lines(plan):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"  predicted: {summary_line(plan.predicted, plan.world_size)}", soft_wrap=True)
    mfu = float(plan.predicted.mfu) if plan.predicted else 0.0
    if mfu > 1.0:
        console.print(f"  [yellow]warning[/yellow]: predicted {mfu_advice(mfu, on_cpu=False)} (a layer profile "
                      "measured faster than that peak)", soft_wrap=True)
    stages = _stages(plan.predicted)
    if (line := dp_line(plan.predicted)) is not None:
        console.print(f"  {line}", soft_wrap=True)
    for line in sharding_lines(plan):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    if stages and all(_source(s) == "modelled" for s in stages):
        console.print("  every stage modelled (analytic cost model: no layer profile matched)")
    elif plan.inputs.layer_profiles:
        console.print(f"  measured layer profiles used: {', '.join(sha[:12] for sha in plan.inputs.layer_profiles)}")
    for problem in (plan.predicted.problems or []) if plan.predicted else []:
        console.print(f"  [red]problem[/red]: {problem}")


def render_baseline(console: Console, plan: Plan, baseline: Plan | None, reason: str = "") -> None:
    """One line each for the plan and the uniform baseline, and their tokens/s ratio."""
    console.print(f"  {plan.inputs.strategy:>9}: {summary_line(plan.predicted, plan.world_size)}", soft_wrap=True)
    if baseline is None:
        console.print(f"    uniform: {reason or 'no symmetric layout fits'}")
        return
    layout = f"{len(baseline.pipelines)}x{len(baseline.pipelines[0].stages)}x{baseline.pipelines[0].stages[0].tp}"
    console.print(f"    uniform: {summary_line(baseline.predicted, baseline.world_size)} (DP x PP x TP {layout})",
                  soft_wrap=True)
    a = plan.predicted.tokens_per_s if plan.predicted else None
    b = baseline.predicted.tokens_per_s if baseline.predicted else None
    if a and b:
        console.print(f"  {gain_line(plan.inputs.strategy, a / b)}", markup=False, highlight=False, soft_wrap=True)


def gain_line(strategy: str, ratio: float) -> str:
    """The predicted tokens/s ratio of a plan to the best symmetric layout, beside the cost model's stated error
    (semantics/stated_error.py): a gain within it is flagged as one the model cannot tell from none."""
    error = MEDIAN_STEP_ERROR
    line = f"ratio {strategy} / uniform: {ratio:.2f}x tokens/s"
    if abs(ratio - 1.0) <= error:
        return (line + f", within the cost model's stated error (median {100 * error:.0f}%, docs/cost-model.md "
                "section 8): the two may run alike; launch both and compare with `flashflex show --run`")
    return line + f" (the cost model's stated error: median {100 * error:.0f}%)"


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
        fmt = (lambda v: f"{v * 100:.2f}%") if m.name in ("mfu", "mfu_cluster") else (lambda v: f"{v:,.6g}")
        table.add_row(m.name, "-" if m.a is None else fmt(m.a), "-" if m.b is None else fmt(m.b),
                      "-" if m.pct is None else f"{m.pct:+.2f}%")
    console.print(table)

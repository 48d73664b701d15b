"""Rich rendering of a RunComparison: one table, predicted and measured side by side, and a legend."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..units import byte_size
from .compare import RunComparison, Term


def _fmt(term: Term, value: float | None) -> str:
    if value is None:
        return "-"
    if term.unit == "B":
        return byte_size(value)
    return f"{1e3 * value:.2f} ms"


def _ratio(term: Term) -> str:
    ratio = term.ratio
    if ratio is None:
        return "-"
    colour = "green" if 0.8 <= ratio <= 1.25 else ("yellow" if 0.5 <= ratio <= 2.0 else "red")
    return f"[{colour}]{ratio:.2f}[/]"


def render_comparison(console: Console, cmp: RunComparison) -> None:
    """Print the per-stage table, the step times and the term that is off most."""
    table = Table(title=f"predicted vs measured (medians of {cmp.steps_used} steps, warm-up left out)",
                  title_justify="left")
    for name, justify in (("stage", "left"), ("term", "left"), ("predicted", "right"), ("measured", "right"),
                          ("measured/predicted", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for sc in cmp.stages:
        for i, term in enumerate(sc.terms):
            label = f"p{sc.pipeline}.s{sc.stage} ({','.join(sc.devices)})" if i == 0 else ""
            name = term.name
            if name == "memory":
                name = "memory, peak allocated" if sc.on_cuda else "memory, peak resident"
            table.add_row(label, name, _fmt(term, term.predicted), _fmt(term, term.measured), _ratio(term),
                          end_section=i == len(sc.terms) - 1)
    console.print(table)
    console.print("  memory: predicted, the stage's peak per device (tensors as the runtime allocates them, the "
                  "allocator's slack); measured, the CUDA allocator's peak on GPUs, the process's peak resident set "
                  "on CPU (the interpreter and torch's libraries included, about 0.4 GiB: compare memory growth, "
                  "the peak above what the rank held before its first step)", soft_wrap=True)
    ratio = cmp.measured_step_s / cmp.predicted_step_s if cmp.predicted_step_s > 0 else float("nan")
    console.print(f"  step time: predicted {1e3 * cmp.predicted_step_s:.1f} ms, measured "
                  f"{1e3 * cmp.measured_step_s:.1f} ms (measured/predicted {ratio:.2f})")
    if cmp.loss_scaling is not None:
        steps, skipped, scale = cmp.loss_scaling
        console.print(f"  fp16 loss scaling: {skipped} of {steps} steps skipped (inf/NaN gradients), last scale "
                      f"{scale:g}")
    if cmp.worst is not None:
        p, s, name, diff = cmp.worst
        console.print(f"  off most: pipeline {p} stage {s} {name}: measured {'+' if diff >= 0 else ''}"
                      f"{1e3 * diff:.1f} ms per step against the prediction")

"""1F1B schedules as op start/end times: predicted (replayed from the cost model's per-stage times) and
measured (timeline.jsonl), drawn to a PNG with matplotlib (optional extra `flashflex[plot]`, Agg backend).

An op is (kind "F" or "B", micro-batch, start_s, end_s), seconds since the step start.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

from ..cost.estimate import Estimate
from ..cost.schedule import stage_order
from ..errors import InputError
from ..fileio import atomic_open
from ..plan.schema import Plan
from .reader import RunRecord

Op = tuple[str, int, float, float]
NEEDS_MATPLOTLIB = "--timeline needs matplotlib: pip install 'flashflex[plot]'"
COLOURS = {"F": "#4C72B0", "B": "#DD8452"}


def replay_1f1b(fwd_s: Sequence[float], bwd_s: Sequence[float], p2p_s: Sequence[float],
                num_micro_batches: int, p2p_back_s: Sequence[float] | None = None) -> list[list[Op]]:
    """Every op of every stage under the dependencies of cost/schedule.simulate_1f1b (same inputs, seconds),
    in each stage's execution order. Stage s may start an op once its previous op ended and its input
    arrived (the forward of stage s - 1 plus p2p_s[s - 1]; the backward of stage s + 1 plus p2p_back_s[s])."""
    back = list(p2p_s if p2p_back_s is None else p2p_back_s)
    count, m = len(fwd_s), num_micro_batches
    orders = [stage_order(s, count, m) for s in range(count)]
    ends: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro) -> end
    out: list[list[Op]] = [[] for _ in range(count)]
    clock = [0.0] * count
    pending = sum(len(o) for o in orders)
    while pending:
        before = pending
        for s in range(count):
            while len(out[s]) < len(orders[s]):
                forward, i = orders[s][len(out[s])]
                if forward:
                    dep = ("F", s - 1, i) if s > 0 else None
                    lag = p2p_s[s - 1] if s > 0 else 0.0
                else:
                    dep = ("B", s + 1, i) if s + 1 < count else ("F", s, i)
                    lag = back[s] if s + 1 < count else 0.0
                if dep is not None and dep not in ends:
                    break
                start = max(clock[s], ends[dep] + lag if dep is not None else 0.0)
                kind = "F" if forward else "B"
                clock[s] = ends[(kind, s, i)] = start + (fwd_s[s] if forward else bwd_s[s])
                out[s].append((kind, i, start, clock[s]))
                pending -= 1
        if pending == before:
            raise RuntimeError("1F1B replay made no progress")
    return out


def predicted_ops(plan: Plan, estimate: Estimate) -> dict[tuple[int, int], list[Op]]:
    """Per (pipeline, stage), the ops of the predicted schedule (gradient transfers taken as long as the
    activation transfers: same bytes)."""
    by_key = {(st.pipeline, st.stage): st for st in estimate.stages}
    out: dict[tuple[int, int], list[Op]] = {}
    for p, pipe in enumerate(plan.pipelines):
        stages = [by_key[(p, s)] for s in range(len(pipe.stages))]
        ops = replay_1f1b([st.fwd_s for st in stages], [st.bwd_s for st in stages],
                          [st.p2p_s for st in stages[:-1]], pipe.num_micro_batches)
        out.update({(p, s): stage_ops for s, stage_ops in enumerate(ops)})
    return out


def measured_ops(plan: Plan, run: RunRecord) -> dict[tuple[int, int], list[Op]]:
    """Per (pipeline, stage), the recorded ops of the run (empty dict when it recorded none)."""
    out = {(p, s): run.stage_ops(p, s) for p, pipe in enumerate(plan.pipelines) for s in range(len(pipe.stages))}
    return out if any(out.values()) else {}


def require_matplotlib() -> None:
    """InputError (exit 2) with the install hint when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError(NEEDS_MATPLOTLIB) from None


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically (fileio.atomic_open: one-line errors, no partial file)."""
    with atomic_open(path, binary=True, mode=0o644) as handle:
        handle.write(data)


def draw_timeline(path: str | os.PathLike[str], plan: Plan, predicted: dict[tuple[int, int], list[Op]],
                  measured: dict[tuple[int, int], list[Op]], title: str = "") -> Path:
    """Draw one panel per pipeline (predicted, and measured below it when given): a row per stage, forward
    and backward ops as bars in two colours, idle time as gaps. Writes the PNG atomically."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [(f"pipeline {p} predicted", p, predicted) for p in range(len(plan.pipelines))]
    if measured:
        panels = [panel for p in range(len(plan.pipelines))
                  for panel in ((f"pipeline {p} predicted", p, predicted), (f"pipeline {p} measured", p, measured))]
    heights = [len(plan.pipelines[p].stages) + 1 for _, p, _ in panels]
    fig = Figure(figsize=(11, 0.45 * sum(heights) + 1.2))
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (label, p, ops) in zip(axes, panels, strict=True):
        count = len(plan.pipelines[p].stages)
        span = max((op[3] for src in (predicted, measured) for s in range(count) for op in src.get((p, s), [])),
                   default=0.0)
        ax.set_xlim(0.0, 1.02e3 * span if span > 0 else 1.0)  # the same scale for predicted and measured
        for s in range(count):
            for kind, micro, start, end in ops.get((p, s), []):
                ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (s - 0.4, 0.8), facecolors=COLOURS[kind],
                               edgecolors="white", linewidth=0.5)
                if count * len(ops.get((p, s), [])) <= 400:
                    ax.text((start + end) / 2 * 1e3, s, str(micro), ha="center", va="center", fontsize=6,
                            color="white")
        ax.set_yticks(range(count), [f"stage {s}" for s in range(count)])
        ax.set_ylim(count - 0.5, -0.5)
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_xlabel("ms since step start", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(handles=[Patch(color=COLOURS["F"], label="forward"), Patch(color=COLOURS["B"], label="backward")],
                   loc="upper right", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    target = Path(path)
    _atomic_write_bytes(target, buffer.getvalue())
    return target

"""Per-step metrics on rank 0: one row per optimizer step, written to every metrics sink the run chose
(runtime/training/sinks/: `RUN_DIR/metrics.jsonl` always, the stderr line, TensorBoard, W&B offline; RunConfig.metrics,
`flashflex launch --metrics`), and the run's summary at its end.

Each JSON line holds at least: step (1-based, as the screen numbers it), launch (which launch into the folder
wrote it), loss, tokens_per_s, mfu, step_time_s, lr, grad_norm, tokens, memory_bytes (largest over ranks; what
`memory_kind` says: "allocated", the CUDA allocator's peak, or "resident", the process's peak resident set on
CPU), and `stages`: per pipeline stage (from its TP rank 0) the
forward_s, backward_s, comm_s (pipeline p2p + gradient sync), optimizer_s and, on CPU, tp_comm_s (the
tensor-parallel all-reduces, included in forward_s and backward_s) of that step; comm_s split into p2p_s and
dp_s, pipeline_s (the whole 1F1B schedule: compute, transfers and waits), memory_bytes (largest over the
stage's TP ranks) and rank_memory_bytes (each TP rank's, in TP order). fp16 runs add `loss_scale` (the scale the step's loss was multiplied by) and `skipped`
(true when inf/NaN gradients made every rank skip the update; the scale then backed off: runtime/training/loss_scale.py).

`RUN_DIR/timeline.jsonl` (`write_timeline`): the compute ops of the last step, one JSON object per stage:
{"step", "pipeline", "stage", "ops": [[kind "F"/"B", micro-batch, start_s, end_s], ...]}, seconds since the
step start on that stage's TP rank 0.
MFU = model FLOPs per token (6N + 12*L*s*h, model/flops.py) * tokens/s / summed peak FLOP/s of the
devices used (emulation slowdown included).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from ...fileio import atomic_write_text
from ...hardware.catalog import GIB
from ...plan.predicted import Predicted
from ...semantics.metrics_sinks import DEFAULT_SINKS, normalized
from ...semantics.run_folder import METRICS, launch_index
from .sinks import open_sinks
from .sinks.console import duration_text, memory_label


def stage_times(plan_ranks: list[Any], per_rank: list[dict[str, float]],
                memory: list[int] | None = None, growth: list[int] | None = None) -> list[dict[str, Any]]:
    """Per-stage times (seconds) from the TP-rank-0 ranks' timings, pipelines then stages; with `memory`
    (peak bytes per rank) and `growth` (peak bytes above what the rank held before the first step), each
    stage's largest."""
    out = []
    for info, timings in zip(plan_ranks, per_rank, strict=True):
        if info.tp_rank != 0:
            continue
        out.append({
            "pipeline": info.pipeline,
            "stage": info.stage,
            "forward_s": round(float(timings.get("forward", 0.0)), 6),
            "backward_s": round(float(timings.get("backward", 0.0)), 6),
            "comm_s": round(float(timings.get("p2p", 0.0)) + float(timings.get("dp_sync", 0.0)), 6),
            "optimizer_s": round(float(timings.get("optimizer", 0.0)), 6),
            "p2p_s": round(float(timings.get("p2p", 0.0)), 6),
            "dp_s": round(float(timings.get("dp_sync", 0.0)), 6),
            "pipeline_s": round(float(timings.get("pipeline", 0.0)), 6),
        })
        mine = [r.rank for r in plan_ranks if (r.pipeline, r.stage) == (info.pipeline, info.stage)]
        if memory is not None:
            out[-1]["memory_bytes"] = max(int(memory[r]) for r in mine)
            out[-1]["rank_memory_bytes"] = [int(memory[r]) for r in mine]
        if growth is not None:
            out[-1]["memory_growth_bytes"] = max(int(growth[r]) for r in mine)
        if "tp_comm" in timings:  # measured on CPU only; part of forward_s and backward_s
            out[-1]["tp_comm_s"] = round(float(timings["tp_comm"]), 6)
        if "dp_total" in timings:  # CPU only: seconds the DP collectives ran, hidden behind the backward or not
            out[-1]["dp_total_s"] = round(float(timings["dp_total"]), 6)
        if "dp_across" in timings:  # CPU only: of which hierarchical reductions' cross-node step (leaders)
            out[-1]["dp_across_s"] = round(float(timings["dp_across"]), 6)
    return out


def stage_ops(plan_ranks: list[Any], per_rank: list[Any], step: int) -> list[dict[str, Any]]:
    """timeline.jsonl rows: per stage (its TP rank 0) the step's compute ops [kind, micro, start_s, end_s]
    (seconds since the step start, rounded to microseconds)."""
    return [{"step": step, "pipeline": info.pipeline, "stage": info.stage,
             "ops": [[kind, int(micro), round(float(a), 6), round(float(b), 6)] for kind, micro, a, b in ops]}
            for info, ops in zip(plan_ranks, per_rank, strict=True) if info.tp_rank == 0]


def write_timeline(run_dir: str | os.PathLike[str], rows: list[dict[str, Any]]) -> Path:
    """Write `run_dir/timeline.jsonl` atomically, one stage per line."""
    return atomic_write_text(Path(run_dir) / "timeline.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


class MetricsLog:
    """Rank 0's metrics: builds one row per step and hands it to each sink (the JSONL file always).

    Rows are numbered as the screen numbers steps: row `"step": k` is the k-th optimizer step, after which a
    checkpoint is `step-00000k`. metrics.jsonl is only ever appended to: a resumed launch adds its rows after the
    earlier ones (steps redone after a crash appear twice; readers keep the last), each row carrying the launch
    it came from (`"launch"`: 0, 1, ... in the folder) so that every launch's first, warm-up step is known."""

    def __init__(self, run_dir: str | os.PathLike[str], total_steps: int, flops_per_token: float,
                 peak_flops: float, quiet: bool = False, device_type: str = "cpu",
                 sinks: tuple[str, ...] = DEFAULT_SINKS, settings: dict[str, Any] | None = None) -> None:
        """flops_per_token: model FLOPs per token; peak_flops: summed peak FLOP/s of the devices used (FLOP/s);
        quiet: no console line whatever `sinks` says; device_type: what `memory_bytes` measures there; sinks:
        the sinks to write (jsonl is added: always on); settings: the run configuration, for the W&B sink."""
        self.path = Path(run_dir) / METRICS
        self.launch = launch_index(self.path)  # before the JSONL sink adds to the file
        chosen = normalized(tuple(name for name in sinks if not (quiet and name == "console")))
        self.sinks = open_sinks(chosen, run_dir, total_steps, device_type, settings)
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.device_type = device_type
        self.rows: list[dict[str, Any]] = []

    def record(self, step: int, loss: float, tokens: int, step_time_s: float, lr: float, grad_norm: float,
               memory_bytes: int, stages: list[dict[str, Any]],
               memory_growth_bytes: int | None = None, loss_scale: float | None = None,
               skipped: bool = False) -> dict[str, Any]:
        """Write optimizer step `step` (1-based: `tokens` processed in `step_time_s` seconds) to every sink;
        returns the row. `memory_growth_bytes`: the largest rank's peak memory above what it held before the first
        step; `loss_scale` (fp16 runs, else None) and `skipped`: the step's loss scale and whether it was skipped."""
        tokens_per_s = tokens / step_time_s if step_time_s > 0 else 0.0
        mfu = self.flops_per_token * tokens_per_s / self.peak_flops if self.peak_flops > 0 else 0.0
        row = {"step": step, "launch": self.launch, "loss": round(loss, 6), "tokens_per_s": round(tokens_per_s, 3),
               "mfu": round(mfu, 6), "step_time_s": round(step_time_s, 6), "lr": lr,
               "grad_norm": round(grad_norm, 6), "tokens": tokens, "memory_bytes": memory_bytes,
               "memory_kind": "allocated" if self.device_type == "cuda" else "resident", "stages": stages}
        if memory_growth_bytes is not None:
            row["memory_growth_bytes"] = memory_growth_bytes
        if loss_scale is not None:
            row["loss_scale"], row["skipped"] = loss_scale, skipped
        for sink in self.sinks:
            sink.write(row)
        self.rows.append(row)
        return row

    def close(self) -> None:
        """Close every sink (the JSONL file, the TensorBoard event file, the W&B run)."""
        for sink in self.sinks:
            sink.close()


def run_summary(rows: list[dict[str, Any]], total_steps: int, wall_s: float, predicted_step_s: float | None,
                compile_s: float | None, checkpoint: str | None, metrics_path: str | os.PathLike[str]) -> list[str]:
    """The end of a run in plain lines: steps trained, wall time (seconds, the launch's), tokens, loss from first
    to last, the median step time against the prediction (flagged when outside the stated band), peak memory,
    the newest checkpoint and the metrics file. `rows`: this launch's metrics rows (each step once)."""
    from ...semantics.stated_error import ratio_is_suspect, suspect_ratio_advice

    if not rows:
        return [f"done: no step trained in {duration_text(wall_s)}"
                + (f"; checkpoint {checkpoint}" if checkpoint else ""), f"metrics: {metrics_path}"]
    first, last = rows[0], rows[-1]
    tokens = sum(int(r.get("tokens", 0)) for r in rows)
    lines = [f"done: steps {first['step']}-{last['step']} of {total_steps} in {duration_text(wall_s)} wall"
             + (f", {tokens:,} tokens" if tokens else "")
             + f", loss {float(first['loss']):.4f} -> {float(last['loss']):.4f}"]
    times = [float(r["step_time_s"]) for r in (rows[1:] if len(rows) > 1 else rows)]
    measured = statistics.median(times)
    line = f"step time {1e3 * measured:.1f} ms (median of {len(times)} steps)"
    ratio = None
    if predicted_step_s:
        ratio = measured / predicted_step_s
        line += f", predicted {1e3 * predicted_step_s:.1f} ms: measured/predicted {ratio:.2f}"
    if compile_s is not None:
        line += f"; compile warm-up {compile_s:.1f} s before the first step"
    lines.append(line)
    kind = str(last.get("memory_kind", "resident"))
    device = "cuda" if kind == "allocated" else "cpu"
    lines.append(f"memory: {max(int(r['memory_bytes']) for r in rows) / GIB:.2f} GiB {memory_label(device)} "
                 "(largest rank)")
    if ratio is not None and ratio_is_suspect(ratio):
        lines.append(f"warning: {suspect_ratio_advice(ratio, device == 'cpu')}")
    lines.append(f"checkpoint: {checkpoint}" if checkpoint else "checkpoint: none (--no-checkpoint)")
    lines.append(f"metrics: {metrics_path}")
    return lines


def predicted_step_seconds(predicted: Predicted | None) -> float | None:
    """The predicted iteration time (seconds) of a plan's `predicted` block (None: no prediction, or zero)."""
    if predicted is None or predicted.iteration_time_s <= 0:
        return None
    return float(predicted.iteration_time_s)

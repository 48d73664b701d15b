"""The one interface of a metrics sink, and the scalar series every charting sink writes."""

from __future__ import annotations

from typing import Any, Protocol

# The row's scalar series a charting sink (TensorBoard, W&B) writes, each under a stable tag: loss (nats per
# token), tokens_per_s, mfu (a fraction), step_time_s (s), lr, grad_norm (before clipping), memory_bytes (the
# largest rank's peak, bytes), loss_scale (fp16 runs only).
SCALAR_TAGS: dict[str, str] = {
    "loss": "train/loss",
    "tokens_per_s": "train/tokens_per_s",
    "mfu": "train/mfu",
    "step_time_s": "train/step_time_s",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "memory_bytes": "train/memory_bytes",
    "loss_scale": "train/loss_scale",
}


class MetricsSink(Protocol):
    """Somewhere rank 0 writes its metrics rows (runtime/training/metrics.py's rows: `step` 1-based, loss, ...)."""

    def write(self, row: dict[str, Any]) -> None:
        """Take one optimizer step's row."""

    def close(self) -> None:
        """Flush and release what the sink holds; no write follows."""


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's scalar series by tag (SCALAR_TAGS); a series the row lacks is left out."""
    return {tag: float(row[key]) for key, tag in SCALAR_TAGS.items() if row.get(key) is not None}

"""The console sink: one plain line per step on stderr (loss, throughput, MFU, step time, memory, elapsed time and
ETA; plain text, so a SLURM log has it too), and a warning the first time MFU exceeds 100%."""

from __future__ import annotations

import statistics
import time
from typing import Any

from rich.console import Console

from ....hardware.catalog import GIB
from ....semantics.stated_error import mfu_advice


def memory_label(device_type: str) -> str:
    """What a rank's `memory_bytes` measures on this device type: the CUDA allocator's peak of allocated tensors
    on GPUs, the process's peak resident set size (tensors, the allocator's cache, torch's libraries) on CPU."""
    return "peak allocated" if device_type == "cuda" else "peak resident"


def duration_text(seconds: float) -> str:
    """"42s", "3m05s", "2h07m" (rounded down)."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


class ConsoleSink:
    """Prints each row of a run of `total_steps` steps on `device_type` ("cuda" or "cpu"); the ETA is the median
    step time (the first, warm-up step left out) times the steps left."""

    def __init__(self, total_steps: int, device_type: str = "cpu") -> None:
        self.total_steps = total_steps
        self.device_type = device_type
        self.console = Console(stderr=True, highlight=False, soft_wrap=True)
        self.started = time.monotonic()
        self.step_times: list[float] = []
        self._mfu_flagged = False

    def write(self, row: dict[str, Any]) -> None:
        """Print the row's line."""
        step, step_time_s, mfu = int(row["step"]), float(row["step_time_s"]), float(row["mfu"])
        loss_scale, skipped = row.get("loss_scale"), bool(row.get("skipped", False))
        self.step_times.append(step_time_s)
        elapsed = time.monotonic() - self.started
        typical = statistics.median(self.step_times[1:] if len(self.step_times) > 1 else self.step_times)
        eta = typical * max(0, self.total_steps - step)
        self.console.print(
            f"[bold]step {step:>4}/{self.total_steps}[/]  loss [cyan]{float(row['loss']):7.4f}[/]  "
            f"{float(row['tokens_per_s']):9,.0f} tok/s  MFU {100 * mfu:5.2f}%  step {1e3 * step_time_s:7.1f} ms  "
            f"mem {int(row['memory_bytes']) / GIB:5.2f} GiB {memory_label(self.device_type).split()[1]}  "
            f"elapsed {duration_text(elapsed)}  eta {duration_text(eta)}"
            + (f"  scale {loss_scale:g}" if loss_scale is not None else "")
            + ("  [yellow]skipped (inf/NaN gradients)[/]" if skipped else ""))
        if mfu > 1.0 and not self._mfu_flagged:
            self._mfu_flagged = True
            self.console.print(f"[yellow]warning:[/] {mfu_advice(mfu, self.device_type != 'cuda')}")

    def close(self) -> None:
        """Nothing to release."""

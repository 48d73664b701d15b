"""Short texts for a plan's parts, the same in every view (`show`, `diff`, the elastic log)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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


def layer_text(layers: Sequence[int]) -> str:
    """A stage's half-open layer range [first, stop) as people count it: "0-3 (4)"."""
    first, stop = int(layers[0]), int(layers[1])
    return f"{first}-{stop - 1} ({stop - first})"


def sharding_text(plan: Any) -> str:
    """How `plan` (a Plan) keeps its optimizer state, in a few words (semantics/optimizer_shards.py)."""
    sharding = plan.optimizer_sharding
    if sharding is None:
        return "not sharded"
    if not sharding.weights:
        return "sharded across each slice's data-parallel holders, equal shards"
    low, high = min(sharding.weights), max(sharding.weights)
    sizes = f"{low:,}" if low == high else f"{low:,}-{high:,}"
    return f"sharded across each slice's data-parallel holders, shard sizes by per-rank weights {sizes}"

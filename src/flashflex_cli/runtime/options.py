"""Runtime switches: each speed or memory path can be turned off for comparison (benchmarks, debugging).

The record itself lives with the cost model's view of it (semantics/runtime_paths.py): what the runtime
runs is what the cost model charges. Defaults are the fast paths; the plan does not carry them (they change
speed and memory, never the numbers beyond floating-point rounding).
"""

from __future__ import annotations

from ..semantics.runtime_paths import RuntimeOptions

__all__ = ["RuntimeOptions"]

"""The 1F1B order of one pipeline stage (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's default schedule):
what the runtime executes (runtime/parallel/pipeline.py) and what the cost model simulates (cost/schedule.py).

Stage s of S with m micro-batches first runs w = min(S - s - 1, m) warm-up forwards, then alternates one
forward and one backward until every forward ran, then runs the remaining backwards. At most w + 1 micro-batches
are in flight on stage s, so the first stage holds the most activations.
"""

from __future__ import annotations

FORWARD, BACKWARD = "F", "B"


def warmup_forwards(num_stages: int, stage: int, num_micro: int) -> int:
    """Forwards stage `stage` runs before its first backward: min(num_stages - stage - 1, num_micro)."""
    return min(num_stages - stage - 1, num_micro)


def one_f_one_b(num_stages: int, stage: int, num_micro: int) -> list[tuple[str, int]]:
    """The operations of `stage` in order: (FORWARD, i) the forward of micro-batch i, (BACKWARD, i) its backward."""
    warmup = warmup_forwards(num_stages, stage, num_micro)
    ops: list[tuple[str, int]] = [(FORWARD, i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        ops.append((FORWARD, warmup + i))
        ops.append((BACKWARD, i))
    ops.extend((BACKWARD, i) for i in range(num_micro - warmup, num_micro))
    return ops

"""The order in which a step's gradients become final, so reductions can start during the backward pass: one key
per global parameter, larger keys finishing earlier. The runtime posts its gradient buckets by descending key
(runtime/parallel/grad_buckets.py) and the cost model schedules its DP reductions by the same keys (cost/dp.py).

The head finishes first, then the final norm, then the transformer layers from the last to the first (a layer's
key is its index), the embedding last (its lookup is the first stage's last backward; with tied embeddings the
last stage's copy is summed with it, so it waits for it anyway).
"""

from __future__ import annotations

KEY_NORM = 1 << 30  # above every layer index
KEY_HEAD = KEY_NORM + 1
KEY_EMBED = -1
KEY_UNORDERED = 0  # a bucket reduced after the whole backward (one per holder set)


def backward_key(name: str) -> int:
    """The backward-order key of global parameter `name` (semantics/parameters.py names)."""
    if name == "head":
        return KEY_HEAD
    if name == "norm":
        return KEY_NORM
    if name.startswith("layers."):
        return int(name.split(".")[1])
    return KEY_EMBED


def overlap_order(key: int, holders: tuple) -> tuple:
    """Sort key of an overlapped bucket: descending backward key, then its holders (sorted ranks in the
    runtime, sorted (pipeline, stage) keys in the cost model: both list pipelines, then stages, in order)."""
    return -key, holders

"""TP groups of the layout space: the degrees a model supports and the ways to cut devices into groups.

A TP group's degree d is any value the model supports (`ModelSpec.supports_tp`: d divides query heads, key/value
heads and the MLP width, powers of two or not). Devices are cut into groups in the order given (local-index order
inside a node block, so a group is contiguous there). Pure functions of counts and degrees (device indices in,
tuples of device indices out); level 2 (`structure.stage_search`) chooses among them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from functools import lru_cache

from ...model.spec import ModelSpec

Devs = tuple[int, ...]
MAX_OPTIONS = 12  # group-size options per block, unless the caller asks for more


def tp_degrees(model: ModelSpec, largest: int) -> list[int]:
    """Supported TP degrees from 1 to `largest`, ascending."""
    return [d for d in range(1, largest + 1) if model.supports_tp(d)]


def chunk(devs: Sequence[int], degree: int, degrees: Sequence[int]) -> list[Devs]:
    """Cut `devs` into groups of `degree`; the remainder into the largest supported degrees that fit."""
    out: list[Devs] = []
    whole = len(devs) - len(devs) % degree
    out.extend(tuple(devs[i:i + degree]) for i in range(0, whole, degree))
    rest = list(devs[whole:])
    while rest:
        size = max(d for d in degrees if d <= len(rest))
        out.append(tuple(rest[:size]))
        rest = rest[size:]
    return out


def chunk_sizes(count: int, degree: int, degrees: Sequence[int]) -> list[int]:
    """Group sizes of `chunk`: groups of `degree`, the remainder in the largest supported degrees."""
    return list(_chunk_sizes(count, degree, tuple(degrees)))


@lru_cache(maxsize=1024)
def _chunk_sizes(count: int, degree: int, degrees: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(len(group) for group in chunk(list(range(count)), degree, degrees))


def cut(devs: Sequence[int], sizes: Sequence[int]) -> list[Devs]:
    """Cut `devs` (local-index order) into consecutive groups of the given sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(tuple(devs[start:start + size]))
        start += size
    return out


def size_options(count: int, degrees: Sequence[int], limit: int = MAX_OPTIONS,
                 every: bool = True) -> list[tuple[int, ...]]:
    """Group sizes for a node block of `count` devices: partitions into supported degrees, fewest groups
    first, each in every distinct order (with `every` and up to 4 groups; else descending and ascending),
    at most `limit`."""
    return list(_size_options(count, tuple(degrees), limit, every))


@lru_cache(maxsize=1024)
def _size_options(count: int, degrees: tuple[int, ...], limit: int, every: bool) -> tuple[tuple[int, ...], ...]:
    out: list[tuple[int, ...]] = []
    for part in sorted(partitions(count, degrees), key=lambda p: (len(p), p)):
        seqs = sorted(set(itertools.permutations(part)), reverse=True) if every and len(part) <= 4 else \
            [part, tuple(reversed(part))]
        for seq in seqs:
            if seq not in out:
                out.append(seq)
    return tuple(out[:limit])


@lru_cache(maxsize=1024)
def partitions(n: int, degrees: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Partitions of `n` devices into groups of the given degrees, parts descending, largest parts first."""
    if n == 0:
        return ((),)
    out: list[tuple[int, ...]] = []
    for d in sorted(degrees, reverse=True):
        if d <= n:
            out.extend((d, *rest) for rest in partitions(n - d, tuple(x for x in degrees if x <= d)))
    return tuple(out)

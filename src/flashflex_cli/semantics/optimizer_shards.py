"""Which rank holds which range of which parameter slice's optimizer state: torch-free, read by the runtime
(runtime/parallel/sharded_optimizer.py), the checkpoints and the cost model (cost/optimizer_shards.py).

With a sharded optimizer (the plan's `optimizer_sharding`), every finest common slice that two or more stages
hold (`process_groups.SliceHolders` with `needs_reduce`) is cut along its split dimension (the slice's TP dim;
dim 0 for a replicated tensor) into one contiguous range per holder, sizes proportional to the holders' weights
(`OptimizerSharding.weights`, one per rank: the plan's measure of what each device can afford, equal when
absent), floor-rounded so the ranges tile the slice exactly. The holder of a range keeps the fp32 AdamW moments
of that range only, updates that range of the fp32 master weights, and the others receive it by all-gather.
Slices that one stage alone holds are not sharded (no data-parallel reduction: every rank keeps their state).

Every piece is a slice along one dimension of the full tensor (name, dim, start, stop), the form checkpoints
already store (runtime/parallel/shards.ShardSpec), so a sharded checkpoint loads under any plan and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .parameters import model_params
from .process_groups import SliceHolders, layout_key, slice_holders


@dataclass(frozen=True)
class ShardPiece:
    """The range [start, stop) along `dim` of the full tensor `name` whose optimizer state `rank` holds; it lies
    inside slice `slice_index` of the global slice list (`slice_holders`). `rows`: the size of the other
    dimensions (elements per index along `dim`)."""

    name: str
    dim: int
    start: int
    stop: int
    rank: int
    slice_index: int
    rows: int

    @property
    def numel(self) -> int:
        """Elements of this piece."""
        return (self.stop - self.start) * self.rows


def split_proportional(length: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Cut [0, length) into len(weights) contiguous ranges, range i about length * w_i / sum(w) long (floor of
    the cumulative share, so the ranges tile exactly and do not depend on float summation order beyond that)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("shard weights must sum to more than 0")
    cuts, acc = [0], 0.0
    for weight in weights[:-1]:
        acc += weight
        cuts.append(min(length, int(length * acc / total)))
    cuts.append(length)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def rank_weights(plan: Any) -> list[float] | None:
    """Per rank, the relative shard size the plan asks for; None when the plan does not shard (no
    `optimizer_sharding`). Equal weights when the sharding gives none."""
    sharding = getattr(plan, "optimizer_sharding", None)
    if sharding is None:
        return None
    world = sum(stage.tp for pipe in plan.pipelines for stage in pipe.stages)
    weights = getattr(sharding, "weights", None)
    return [float(w) for w in weights] if weights else [1.0] * world


def split_dim(sl: SliceHolders) -> int:
    """The dimension a slice's state is cut along: its own TP dim, or 0 for a whole (replicated) tensor."""
    return 0 if sl.dim is None else sl.dim


def slice_pieces(sl: SliceHolders, index: int, shape: tuple[int, ...], weights: Sequence[float]) -> list[ShardPiece]:
    """One piece per holder of `sl` (holder order), sizes proportional to the holders' `weights` (per rank)."""
    dim = split_dim(sl)
    lo, hi = (0, shape[0]) if sl.dim is None else (sl.start, sl.stop)
    rows = 1
    for d, size in enumerate(shape):
        if d != dim:
            rows *= size
    ranges = split_proportional(hi - lo, [weights[r] for r in sl.ranks])
    return [ShardPiece(sl.name, dim, lo + a, lo + b, rank, index, rows)
            for rank, (a, b) in zip(sl.ranks, ranges, strict=True)]


def plan_pieces(plan: Any, slices: list[SliceHolders] | None = None) -> list[ShardPiece]:
    """Every piece of every sharded slice of `plan` (slice order, then holder order); [] when the plan does not
    shard its optimizer state."""
    weights = rank_weights(plan)
    if weights is None:
        return []
    shapes = {info.name: info.shape for info in model_params(plan.inputs.model)}
    slices = slice_holders(plan) if slices is None else slices
    return [piece for index, sl in enumerate(slices) if sl.needs_reduce
            for piece in slice_pieces(sl, index, shapes[sl.name], weights)]


@dataclass(frozen=True)
class ShardCounts:
    """One rank's share of the sharded slices, in elements: `held`, of the sharded slices it holds; `own`, of
    its pieces of them."""

    held: int = 0
    own: int = 0


_COUNTS: dict[tuple, list[ShardCounts]] = {}  # the last few (layout, weights): a plan is estimated several times
_COUNTS_KEPT = 8


def shard_counts(plan: Any) -> list[ShardCounts]:
    """Per rank, its ShardCounts (all zero when the plan does not shard). Its optimizer state covers its local
    elements minus `held` plus `own`."""
    world = sum(stage.tp for pipe in plan.pipelines for stage in pipe.stages)
    weights = rank_weights(plan)
    if weights is None:
        return [ShardCounts()] * world
    key = (layout_key(plan), tuple(weights))
    found = _COUNTS.get(key)
    if found is not None:
        return found
    held, own = [0] * world, [0] * world
    shapes = {info.name: info.shape for info in model_params(plan.inputs.model)}
    for sl in slice_holders(plan):
        if not sl.needs_reduce:
            continue
        shape = shapes[sl.name]
        dim = split_dim(sl)
        rows = 1
        for d, size in enumerate(shape):
            if d != dim:
                rows *= size
        length = shape[0] if sl.dim is None else sl.stop - sl.start
        whole = length * rows
        for rank, (a, b) in zip(sl.ranks, split_proportional(length, [weights[r] for r in sl.ranks]), strict=True):
            held[rank] += whole
            own[rank] += (b - a) * rows
    found = [ShardCounts(*counts) for counts in zip(held, own, strict=True)]
    if len(_COUNTS) >= _COUNTS_KEPT:
        _COUNTS.pop(next(iter(_COUNTS)))
    _COUNTS[key] = found
    return found


def sharded_elements(plan: Any) -> list[int]:
    """Per rank, the elements whose optimizer state sharding takes off it (`shard_counts`: held minus own)."""
    return [counts.held - counts.own for counts in shard_counts(plan)]

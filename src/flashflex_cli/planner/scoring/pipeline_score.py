"""Evaluate one pipeline (an ordered list of TP groups) with the planner's fast model.

For stages s = 0..S-1 with TP groups `stages[s]` (device indices of the DeviceGraph):
per-layer time t_s and embedding / head time from the cost model, memory cap c_s for in_flight = S - s
micro-batches (1F1B: stage s keeps S - s micro-batches' activations alive, since every pipeline gets at
least S micro-batches), then the exact min-max layer split (`layer_split.split_layers`). The result gives
the pipeline's pace and fill in the cost model's closed form of 1F1B (`cost.schedule.steady_period_s`: seconds
per micro-batch in steady state, the slowest stage or, with transfer latency, the slowest window of stages;
`cost.schedule.fill_s`: stage times plus a forward and a backward transfer per hop) and its largest per-device
gradient shard and largest per-stage gradient (bytes), which the data-parallel term of the candidate score
needs. The answers are memoised per cache (`PipelineMemo`) by devices and by pipeline shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

from ...cost.schedule import fill_s, steady_period_s
from ..space.layer_split import split_layers, stage_times
from .cost_cache import CostCache, Devs


@dataclass(frozen=True)
class PipeEval:
    """A pipeline with its layer split; `ok` False when the layers cannot fit (counts empty then)."""

    stages: tuple[Devs, ...]
    counts: tuple[int, ...]
    pace_s: float
    fill_s: float
    shard_bytes: float
    ok: bool
    stage_grad_bytes: float = 0.0

    @property
    def num_stages(self) -> int:
        """Number of stages."""
        return len(self.stages)

    @cached_property
    def devices(self) -> tuple[int, ...]:
        """Every device of the pipeline in stage order."""
        return tuple(i for stage in self.stages for i in stage)

    @cached_property
    def first_device(self) -> int:
        """The pipeline's smallest device index (candidates order their pipelines by it)."""
        return min(min(stage) for stage in self.stages)


_INFEASIBLE = float("inf")


class PipelineMemo:
    """One cache's pipeline evaluations: by devices (`by_devices`), by shape (equal node classes and local
    indices, equal links between stages: `by_shape`), and each stage's terms (`stage_terms`: one layer's seconds,
    embedding / head seconds and the layers that fit, by (devices, first, last, in-flight micro-batches))."""

    __slots__ = ("by_devices", "by_shape", "stage_terms")

    def __init__(self) -> None:
        self.by_devices: dict[tuple[Devs, ...], PipeEval] = {}
        self.by_shape: dict[tuple, PipeEval] = {}
        self.stage_terms: dict[tuple, tuple[float, float, int]] = {}


def evaluated(cache: CostCache) -> Iterator[PipeEval]:
    """Every pipeline evaluated on `cache` so far (for diagnostics: what fit, at how many stages)."""
    return iter(cache.memo(PipelineMemo).by_devices.values())


def evaluate_pipeline(cache: CostCache, stages: tuple[Devs, ...],
                      links: Callable[[], list[float]] | None = None) -> PipeEval:
    """Split layers over `stages` and return the pipeline's pace, fill and gradient shard size. `links`: where
    the caller has them, the `CostCache.p2p` seconds between consecutive stages (called only when needed)."""
    found = _memoised(cache, stages)
    if isinstance(found, PipeEval):
        return found
    pipe = _finish(cache, stages, found, *stage_terms(cache, stages), links)
    assert pipe is not None
    return pipe


def evaluate_unless(cache: CostCache, stages: tuple[Devs, ...], links: Callable[[], list[float]],
                    skip: Callable[[list[float], list[float], float], bool],
                    terms: tuple[list[float], list[float], list[int]] | None = None,
                    shape: Callable[[], tuple] | None = None,
                    split: tuple[list[int] | None] | None = None) -> PipeEval | None:
    """`evaluate_pipeline`, or None (nothing memoised) when `skip(times, links, fill)` says so once the layer
    split is known: `times` are the stages' seconds per micro-batch (forward + backward), `links` the transfer
    seconds between them and `fill` the exact fill (seconds), so a caller that only wants pipelines below some cost
    learns early that this one is not (before its period, its memo keys and its gradient sizes are computed). A
    pipeline whose layers do not fit is returned (`ok` False) but not memoised. `terms`: `stage_terms(cache, stages)`,
    `shape`: gives `shape_key(cache, stages)`, `split`: (`layer_split.split_layers` of the terms,), where the caller
    has them (a caller with the shape knows the stages are new: the memo by devices is not consulted). The memo by
    shape is consulted only for a pipeline not skipped (the figures are the same either way)."""
    if shape is None:
        hit = cache.memo(PipelineMemo).by_devices.get(tuple(stages))
        if hit is not None:
            return hit
    return _finish(cache, stages, None, *(terms or stage_terms(cache, stages)), links, skip, looked_up=False,
                   known_shape=shape, known_split=split)


def _memoised(cache: CostCache, stages: tuple[Devs, ...]) -> PipeEval | tuple:
    """The memoised evaluation of `stages` (by devices, else by shape), or the shape key to store it under."""
    hit = cache.memo(PipelineMemo).by_devices.get(tuple(stages))
    if hit is not None:
        return hit
    shape = shape_key(cache, stages)
    return _same_shape(cache, stages, shape) or shape


def shape_key(cache: CostCache, stages: Sequence[Devs]) -> tuple:
    """Pipelines of equal shape (equal node classes and local indices, equal links between stages) elsewhere in the
    cluster cost the same: the stages' `CostCache.stage_key`s, and the bandwidth between the nodes of consecutive
    stages (-1 inside a node)."""
    g = cache.graph
    node_of, bw = g.node_list, g.node_bw_rows
    nodes = [node_of[st[0]] for st in stages]
    stage_key = cache.stage_key
    return (tuple([stage_key(st) for st in stages]),
            tuple([bw[a][b] if a != b else -1.0 for a, b in zip(nodes, nodes[1:], strict=False)]))


def _same_shape(cache: CostCache, stages: tuple[Devs, ...], shape: tuple) -> PipeEval | None:
    """The memoised figures of a pipeline of shape `shape`, with the devices of `stages` (memoised by them)."""
    memos = cache.memo(PipelineMemo)
    same = memos.by_shape.get(shape)
    if same is None:
        return None
    hit = memos.by_devices[tuple(stages)] = PipeEval(tuple(stages), same.counts, same.pace_s, same.fill_s,
                                                     same.shard_bytes, same.ok, same.stage_grad_bytes)
    return hit


def stage_terms(cache: CostCache, stages: tuple[Devs, ...]) -> tuple[list[float], list[float], list[int]]:
    """Per stage: one layer's seconds, the embedding / head seconds, and the layers that fit in memory."""
    count, end = len(stages), len(stages) - 1
    rows = []
    terms = cache.memo(PipelineMemo).stage_terms
    get = terms.get
    for s, devs in enumerate(stages):
        found = get((devs, s == 0, s == end, count - s))
        if found is None:
            cost = cache.stage(devs)
            first, last = s == 0, s == end
            found = terms[(devs, first, last, count - s)] = (
                cost.layer_s, (cost.embed_s if first else 0.0) + (cost.head_s if last else 0.0),
                cache.max_layers(len(devs), first, last, count - s, cache.capacity(devs)))
        rows.append(found)
    return [row[0] for row in rows], [row[1] for row in rows], [row[2] for row in rows]


def _finish(cache: CostCache, stages: tuple[Devs, ...], shape: tuple | None, per_layer: list[float],
            extra: list[float], caps: list[int], known_links: Callable[[], list[float]] | None = None,
            skip: Callable[[list[float], list[float], float], bool] | None = None, looked_up: bool = True,
            known_shape: Callable[[], tuple] | None = None,
            known_split: tuple[list[int] | None] | None = None) -> PipeEval | None:
    """The layer split and figures of `stages` from its stage terms; memoised by devices and by `shape` (None:
    `known_shape()`, else `shape_key`); the memo by shape is looked up first (unless the caller has,
    `looked_up`) when not skipped; None, memoised nowhere, when `skip` says so (see `evaluate_unless`)."""
    count = len(stages)
    split = split_layers(per_layer, extra, caps, cache.model.num_layers) if known_split is None else known_split[0]
    if split is not None:
        times = stage_times(per_layer, extra, split)
        links = known_links() if known_links is not None else \
            [cache.p2p(stages[s], stages[s + 1]) for s in range(count - 1)]
        fill = fill_s(times, links)
        if skip is not None and skip(times, links, fill):
            return None
    elif skip is not None:  # what does not fit is not worth a memo entry for a caller that skips
        return PipeEval(tuple(stages), (), _INFEASIBLE, _INFEASIBLE, _INFEASIBLE, False)
    if not looked_up:
        if shape is None:
            shape = known_shape() if known_shape is not None else shape_key(cache, stages)
        found = _same_shape(cache, stages, shape)
        if found is not None:
            return found
    if split is None:
        hit = PipeEval(tuple(stages), (), _INFEASIBLE, _INFEASIBLE, _INFEASIBLE, False)
    else:
        pace = steady_period_s(times, links)
        grad = cache.layer_grad_bytes
        sizes = [n * grad for n in split]
        sizes[0] += cache.embed_grad_bytes
        sizes[-1] += cache.head_grad_bytes
        shard = max(0.0, max([size / len(devs) for size, devs in zip(sizes, stages, strict=True)]))
        whole = max(0.0, max(sizes))
        hit = PipeEval(tuple(stages), tuple(split), pace, fill, shard, True, whole)
    memos = cache.memo(PipelineMemo)
    memos.by_devices[tuple(stages)] = hit
    memos.by_shape[shape] = hit
    return hit

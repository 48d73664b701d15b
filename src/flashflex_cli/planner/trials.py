"""Trial structures of one pipeline's node blocks, evaluated only when they might win.

A trial is a group-size choice per block and a block order (`stages.assemble`). Each block cut into
groups of given sizes is a `Piece` (kept on the cache: the same blocks recur in many searches): its stages,
their per-layer seconds, the transfer seconds between them and their `bounds.Summary`. A trial is bounded
from its pieces and the transfers where they join (`bounds.runs_lower_bound`'s figures); the sweeps sum what
their trials share once (`sweeps`): a unit sweep (one block's sizes vary) the other pieces' totals, an
order sweep the order-free totals, so a trial costs O(1), resp. O(blocks) joins. A trial with
more stages than layers drops its slowest stages (as `stages.assemble` does) and is bounded over the kept
stages piece by piece (`sweeps.Kept`). Only a trial whose bound is below the best so far is evaluated: its layers
are split exactly, and when its exact fill and slowest stage / adjacent pair of stages (a lower bound on
the window pace) already show that it cannot win, the window search is skipped and nothing is memoised
(`Trials.cost_below`, `pipeline.evaluate_unless`); otherwise it is evaluated in full
(`pipeline.evaluate_pipeline`). All figures in seconds per micro-batch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .bounds import INFEASIBLE, Summary, cannot_beat, runs_lower_bound
from .fastcost import CostCache, Devs
from .pipeline import PipeEval, evaluate_pipeline, evaluate_unless
from .sweeps import Kept, Totals, UnitBounds

Block = tuple[int, list[int]]
T = TypeVar("T")


@dataclass(frozen=True)
class Piece:
    """One block cut into TP groups: the groups (stage order), one layer's seconds on each, the transfer
    seconds between consecutive groups, their summary and the piece's serial number."""

    stages: tuple[Devs, ...]
    speeds: tuple[float, ...]
    links: tuple[float, ...]
    summary: Summary
    groups: tuple[tuple[list[int | None], int, float], ...]  # per stage: `CostCache.cap_row`, degree, capacity
    embed_s: float  # the embedding's seconds on its first stage, the head's on its last
    head_s: float
    serial: int  # its number among the cache's pieces (`CostCache.pieces`), the key of its joins


class Trials:
    """Bounded evaluation of trial structures over `blocks` for a pipeline of `micro` micro-batches and at
    most `max_stages` stages (see module docstring)."""

    def __init__(self, cache: CostCache, blocks: list[Block], micro: int, max_stages: int) -> None:
        self.cache, self.blocks, self.micro, self.max_stages = cache, blocks, micro, max_stages
        self._pieces: list[dict[tuple[int, ...], Piece]] = [{} for _ in blocks]  # by block, by group sizes
        self._seen: dict[tuple, tuple[float, PipeEval]] = {}
        self._bounds: dict[tuple, float] = {}
        self._whole: dict[int, Kept] = {}  # `whole` by piece serial

    def piece(self, block: int, sizes: tuple[int, ...]) -> Piece:
        """Block `block` (position in `blocks`) cut into consecutive groups of `sizes` (local-index order)."""
        found = self._pieces[block].get(sizes)
        if found is None:
            found = self._pieces[block][sizes] = self._new_piece(block, sizes)
        return found

    def _new_piece(self, block: int, sizes: tuple[int, ...]) -> Piece:
        """`piece`, from the cache's pieces (the same block devices recur in many searches) or built."""
        cache = self.cache
        devs = self.blocks[block][1]
        whole = (tuple(devs), sizes)
        found = cache.pieces.get(whole)
        if found is None:
            start, parts = 0, []
            for size in sizes:
                parts.append(tuple(devs[start:start + size]))
                start += size
            # equal blocks (node class, local indices) cut equally cost the same, in every search of the cache
            node = self.blocks[block][0]
            shape = (cache.stage_key(whole[0]), cache.graph.node_bw_rows[node][node], sizes)
            known = cache.piece_memo.get(shape)
            if known is None:
                stage, p2p, capacity = cache.stage, cache.p2p, cache.capacity
                speeds = tuple(stage(st).layer_s for st in parts)
                links = tuple(p2p(parts[j], parts[j + 1]) for j in range(len(parts) - 1))
                groups = tuple((cache.cap_row(len(st), capacity(st)), len(st), capacity(st)) for st in parts)
                known = cache.piece_memo[shape] = (speeds, links, Summary.of(speeds, links), groups,
                                                   stage(parts[0]).embed_s, stage(parts[-1]).head_s)
            found = cache.pieces[whole] = Piece(tuple(parts), *known, len(cache.pieces))
        return found  # type: ignore[return-value]

    def _pieces_of(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...]) -> list[Piece]:
        tables, out = self._pieces, []
        for b in order:
            found = tables[b].get(sizes[b])
            out.append(self.piece(b, sizes[b]) if found is None else found)
        return out

    def stages(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...]) -> tuple[Devs, ...]:
        """The trial's stages, exactly as `stages.assemble` builds them."""
        return self._assemble(self._pieces_of(sizes, order))[0]

    def _assemble(self, pieces: list[Piece]) -> tuple[tuple[Devs, ...], list[int] | None]:
        """The stages of `pieces` in order, and when the slowest were dropped, the positions kept."""
        stages = [st for piece in pieces for st in piece.stages]
        layers = self.cache.model.num_layers
        if len(stages) <= layers:
            return tuple(stages), None
        keep = _kept([t for piece in pieces for t in piece.speeds], layers)
        return tuple([stages[s] for s in keep]), keep

    def join(self, before: Piece, after: Piece) -> float:
        """Transfer seconds from `before`'s last stage to `after`'s first (`CostCache.p2p`), memoised by the
        pieces' serial numbers (`CostCache.piece_joins`)."""
        key = (before.serial, after.serial)
        joins = self.cache.piece_joins
        found = joins.get(key)
        if found is None:
            found = joins[key] = self.cache.p2p(before.stages[-1], after.stages[0])
        return found

    def _links(self, pieces: list[Piece], stages: Sequence[Devs], keep: list[int] | None) -> list[float]:
        """Transfer seconds between consecutive `stages` (`CostCache.p2p`), the pieces' stages, or when some
        were dropped (`keep` not None), the ones kept (a pair that was adjacent keeps its link)."""
        joins, p2p = self.cache.piece_joins, self.cache.p2p
        before = pieces[0]
        raw = list(before.links)
        for after in pieces[1:]:
            key = (before.serial, after.serial)  # `join`, inlined (the hot path)
            found = joins.get(key)
            if found is None:
                found = joins[key] = p2p(before.stages[-1], after.stages[0])
            raw.append(found)
            raw.extend(after.links)
            before = after
        if keep is None:
            return raw
        return [raw[keep[s]] if keep[s + 1] == keep[s] + 1 else p2p(stages[s], stages[s + 1])
                for s in range(len(stages) - 1)]

    def cost(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...], key: tuple | None = None
             ) -> tuple[float, PipeEval]:
        """The trial's exact amortised seconds per micro-batch (`amortised`) and its evaluation (memoised;
        `key`: the trial's `key` where the caller has it)."""
        if key is None:
            key = self.key(sizes, order)
        hit = self._seen.get(key)
        if hit is None:
            pieces = self._pieces_of(sizes, order)
            stages, keep = self._assemble(pieces)
            pipe = evaluate_pipeline(self.cache, stages, lambda: self._links(pieces, stages, keep))
            hit = self._seen[key] = (amortised(pipe, self.micro, self.max_stages), pipe)
        return hit

    def cost_below(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...], key: tuple, limit: float
                   ) -> float:
        """`cost`, or inf when the trial's figures once its layers are split show that it cannot be below
        `limit` (`pipeline.evaluate_unless`; a lower bound then goes to the bounds memo)."""
        hit = self._seen.get(key)
        if hit is not None:
            return hit[0]
        pieces = self._pieces_of(sizes, order)
        stages, keep = self._assemble(pieces)
        micro, most = self.micro, self.max_stages
        low: list[float] = []

        def skip(pace: float, fill: float, count: int) -> bool:
            if count > most:
                return False  # inf: evaluated, as `amortised` has it
            m = max(micro, count)
            low.append((fill + (m - 1) * pace) / m)
            return cannot_beat(low[0], limit)

        terms = None if keep is not None else self._terms(pieces, len(stages))
        pipe = evaluate_unless(self.cache, stages, lambda: self._links(pieces, stages, keep), skip, terms)
        if pipe is None:
            self._bounds[key] = low[0]
            return float("inf")
        hit = self._seen[key] = (amortised(pipe, micro, most), pipe)
        return hit[0]

    def _terms(self, pieces: list[Piece], count: int) -> tuple[list[float], list[float], list[int]]:
        """`pipeline._terms` of the stages of `pieces` (all kept, `count` of them) from the pieces' figures."""
        cache = self.cache
        per_layer: list[float] = []
        caps: list[int] = []
        in_flight = count
        for piece in pieces:
            per_layer.extend(piece.speeds)
            for row, tp, capacity in piece.groups:
                found = row[in_flight]
                caps.append(cache.middle_cap(row, tp, capacity, in_flight) if found is None else found)
                in_flight -= 1
        extra = [0.0] * count
        first, last = pieces[0], pieces[-1]
        _, tp, capacity = first.groups[0]
        if count == 1:
            extra[0] = first.embed_s + last.head_s
            caps[0] = cache.max_layers(tp, True, True, 1, capacity)
        else:
            extra[0], extra[-1] = first.embed_s, last.head_s
            caps[0] = cache.max_layers(tp, True, False, count, capacity)
            _, tp, capacity = last.groups[-1]
            caps[-1] = cache.max_layers(tp, False, True, 1, capacity)
        return per_layer, extra, caps

    @staticmethod
    def key(sizes: dict[int, tuple[int, ...]], order: tuple[int, ...]) -> tuple:
        """The memo key of a trial (dicts in one key order: at worst a miss)."""
        return tuple(sizes.items()), order

    def bound(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...], key: tuple | None = None) -> float:
        """A lower bound on `cost` (the exact figure when already known; `key`: the trial's `key` where the
        caller has it)."""
        if key is None:
            key = self.key(sizes, order)
        hit = self._seen.get(key)
        if hit is not None:
            return hit[0]
        known = self._bounds.get(key)
        if known is None:
            known = self._bounds[key] = self._bound(key, sizes, order)
        return known

    def _bound(self, key: tuple, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...]) -> float:
        pieces = self._pieces_of(sizes, order)
        layers = self.cache.model.num_layers
        if sum(piece.summary.count for piece in pieces) <= layers:
            join = self.join
            joins = [join(pieces[i], pieces[i + 1]) for i in range(len(pieces) - 1)]
            return runs_lower_bound([piece.summary for piece in pieces], joins, pieces[0].embed_s, pieces[-1].head_s,
                                    layers, self.micro, self.max_stages)
        return self._dropped_bound(pieces)

    def _dropped_bound(self, pieces: list[Piece], cut_room: tuple[float, int] | None = None) -> float:
        """`bounds.stages_lower_bound` of the stages kept when the slowest are dropped (as `_assemble` keeps
        them: the L fastest, ties to the earlier), summed piece by piece (`Kept`). `cut_room`: `cut_room(pieces)`
        where the caller has it (it does not depend on the pieces' order)."""
        layers = self.cache.model.num_layers
        if layers > self.max_stages:
            return INFEASIBLE
        cut, room = cut_room or self.cut_room(pieces)
        return Kept(self.cache, pieces, cut, room).bound(self)

    def whole(self, piece: Piece) -> Kept:
        """`Kept` of `piece` alone when every stage of it is kept (the same whatever the cut speed; memoised)."""
        found = self._whole.get(piece.serial)
        if found is None:
            found = self._whole[piece.serial] = Kept(self.cache, [piece], float("inf"), 0)
        return found

    def cut_room(self, pieces: Sequence[Piece]) -> tuple[float, int]:
        """The per-layer seconds of the L-th fastest stage of `pieces` (L layers) and how many stages at exactly
        that speed are kept (the L fastest, ties to the earlier)."""
        return _cut_room([t for piece in pieces for t in piece.speeds], self.cache.model.num_layers)

    def _bounds_of(self, trials: list[tuple[dict[int, tuple[int, ...]], tuple[int, ...]]], keys: list[tuple]
                   ) -> list[float]:
        """`bound` of each trial; trials that share their group sizes (the same dict) and differ in block order
        share the order-free totals (`Totals`)."""
        totals: dict[int, Totals] = {}
        layers = self.cache.model.num_layers

        def compute(trial: tuple[dict[int, tuple[int, ...]], tuple[int, ...]], key: tuple) -> float:
            sizes, order = trial
            found = totals.get(id(sizes))
            if found is None:
                found = totals[id(sizes)] = Totals(self, sizes)
            if found.count <= layers:
                return found.bound(order)
            return self._dropped_bound([found.pieces[b] for b in order], found.cut_room())

        return self.memo_bounds(trials, keys, compute)

    def memo_bounds(self, trials: Sequence[T], keys: list[tuple], compute: Callable[[T, tuple], float]
                    ) -> list[float]:
        """Each trial's bound (`keys`: their `key`s): its exact cost when already evaluated, else its memoised
        bound, else `compute(trial, key)`, memoised (a trial: whatever `compute` needs to tell it apart)."""
        seen, memo = self._seen, self._bounds
        out: list[float] = []
        for trial, key in zip(trials, keys, strict=True):
            hit = seen.get(key)
            if hit is not None:
                out.append(hit[0])
                continue
            known = memo.get(key)
            if known is None:
                known = memo[key] = compute(trial, key)
            out.append(known)
        return out

    def unit_ranked(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...], block: int,
                    options: list[tuple[int, ...]], bar: float) -> list[tuple[float, dict[int, tuple[int, ...]]]]:
        """`ranked` (keep 1) of the trials that give block `block` each of `options` in the trial (`sizes`,
        `order`), as (cost, sizes); their bounds come from the other blocks' totals, summed once."""
        items = tuple(sizes.items())
        at = list(sizes).index(block)
        head, tail = items[:at], items[at + 1:]
        keys = [(head + ((block, option),) + tail, order) for option in options]  # `key`, without a dict each
        bounds = UnitBounds(self, sizes, order, block).bounds(options, keys)
        trials = _OptionTrials(sizes, order, block, options)
        return [(value, trials[j][0]) for value, j in self.ranked(trials, 1, bar, bounds, keys)]

    def ranked(self, trials: Sequence[tuple[dict[int, tuple[int, ...]], tuple[int, ...]]], keep: int, bar: float,
               bounds: list[float] | None = None, keys: list[tuple] | None = None) -> list[tuple[float, int]]:
        """The `keep` best trials strictly below `bar` as (cost, position), by (cost, position).

        Trials are evaluated best-first by lower bound (`bounds`, else `bound`); once a bound shows that a trial
        costs more than the keep-th best found so far (or `bar`), it and every trial after it in that order
        are skipped; a trial whose figures once its layers are split show the same is not evaluated further
        (`cost_below`). `keys`: the trials' `key`s where the caller has them."""
        if keys is None:
            keys = [self.key(sizes, order) for sizes, order in trials]
        if bounds is None:
            bounds = self._bounds_of(trials, keys)
        found: list[tuple[float, int]] = []
        inf = float("inf")
        for j in sorted(range(len(trials)), key=bounds.__getitem__):  # stable: ties in position order
            limit = found[keep - 1][0] if len(found) >= keep else bar
            if limit < inf:  # (with nothing below inf yet, every trial is evaluated: `search._nothing_fits` reads them)
                if cannot_beat(bounds[j], limit):
                    break
            value = self.cost(*trials[j], keys[j])[0] if limit == inf else \
                self.cost_below(*trials[j], keys[j], limit)
            if value < bar:
                found.append((value, j))
                found.sort()
        return found[:keep]


class _OptionTrials(Sequence[tuple[dict[int, tuple[int, ...]], tuple[int, ...]]]):
    """The trials of a unit sweep, (sizes, order) with block `block` at each of `options`, each dict built only
    when asked for (most are bounded away without one)."""

    def __init__(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...], block: int,
                 options: list[tuple[int, ...]]) -> None:
        self.sizes, self.order, self.block, self.options = sizes, order, block, options

    def __len__(self) -> int:
        return len(self.options)

    def __getitem__(self, j: int) -> tuple[dict[int, tuple[int, ...]], tuple[int, ...]]:  # type: ignore[override]
        return {**self.sizes, self.block: self.options[j]}, self.order


def _cut_room(speed: list[float], layers: int) -> tuple[float, int]:
    """The `layers`-th smallest of `speed` (per-layer seconds) and how many stages at exactly that speed are
    kept when the `layers` fastest are (ties to the earlier)."""
    ordered = sorted(speed)
    cut = ordered[layers - 1]
    return cut, layers - bisect_left(ordered, cut)


def _kept(speed: list[float], layers: int) -> list[int]:
    """Positions of the `layers` fastest stages (per-layer seconds `speed`), ties to the earlier, in pipeline
    order (as `stages.assemble`): every stage faster than the layers-th speed, then the first at that speed."""
    cut_speed, room = _cut_room(speed, layers)
    keep = []
    for s, t in enumerate(speed):
        if t < cut_speed:
            keep.append(s)
        elif t == cut_speed and room > 0:
            keep.append(s)
            room -= 1
    return keep


def amortised(pipe: PipeEval, micro: int, max_stages: int) -> float:
    """Seconds per micro-batch when the pipeline runs `micro` micro-batches (inf when it does not fit, or
    has more stages than the `max_stages` micro-batches the whole batch has: 1F1B needs one per stage)."""
    if not pipe.ok or pipe.num_stages > max_stages:
        return float("inf")
    m = max(micro, pipe.num_stages)
    return (pipe.fill_s + (m - 1) * pipe.pace_s) / m

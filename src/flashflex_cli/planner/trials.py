"""Trial structures of one pipeline's node blocks, evaluated only when they might win.

A trial is a group-size choice per block and a block order (`stages.assemble`). Each block cut into
groups of given sizes is a `Piece` (kept on the cache: the same blocks recur in many searches): its stages,
their per-layer seconds, the transfer seconds between them and their `bounds.Summary`. A trial is bounded
from its pieces and the transfers where they join (`bounds.runs_lower_bound`'s figures); the sweeps sum what
their trials share once: a unit sweep (one block's sizes vary, `_UnitBounds`) the other pieces' totals, an
order sweep (`_Totals`) the order-free totals, so a trial costs O(1), resp. O(blocks) joins. A trial with
more stages than layers drops its slowest stages (as `stages.assemble` does) and is bounded over the kept
stages piece by piece (`_Kept`). Only a trial whose bound is below the best so far is evaluated: its layers
are split exactly, and when its exact fill and slowest stage / adjacent pair of stages (a lower bound on
the window pace) already show that it cannot win, the window search is skipped and nothing is memoised
(`Trials.cost_below`, `pipeline.evaluate_unless`); otherwise it is evaluated in full
(`pipeline.evaluate_pipeline`). All figures in seconds per micro-batch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from .bounds import INFEASIBLE, Summary, cannot_beat, combine, runs_lower_bound
from .fastcost import CostCache, Devs
from .pipeline import PipeEval, evaluate_pipeline, evaluate_unless

Block = tuple[int, list[int]]


@dataclass(frozen=True)
class Piece:
    """One block cut into TP groups: the groups (stage order), one layer's seconds on each, the transfer
    seconds between consecutive groups, their summary and the piece's serial number."""

    stages: tuple[Devs, ...]
    speeds: tuple[float, ...]
    links: tuple[float, ...]
    summary: Summary
    serial: int  # its number among the cache's pieces (`CostCache.pieces`), the key of its joins


class Trials:
    """Bounded evaluation of trial structures over `blocks` for a pipeline of `micro` micro-batches and at
    most `max_stages` stages (see module docstring)."""

    def __init__(self, cache: CostCache, blocks: list[Block], micro: int, max_stages: int) -> None:
        self.cache, self.blocks, self.micro, self.max_stages = cache, blocks, micro, max_stages
        self._pieces: list[dict[tuple[int, ...], Piece]] = [{} for _ in blocks]  # by block, by group sizes
        self._seen: dict[tuple, tuple[float, PipeEval]] = {}
        self._bounds: dict[tuple, float] = {}

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
                stage, p2p = cache.stage, cache.p2p
                speeds = tuple(stage(st).layer_s for st in parts)
                links = tuple(p2p(parts[j], parts[j + 1]) for j in range(len(parts) - 1))
                known = cache.piece_memo[shape] = (speeds, links, Summary.of(speeds, links))
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

        pipe = evaluate_unless(self.cache, stages, lambda: self._links(pieces, stages, keep), skip)
        if pipe is None:
            self._bounds[key] = low[0]
            return float("inf")
        hit = self._seen[key] = (amortised(pipe, micro, most), pipe)
        return hit[0]

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
        cache = self.cache
        pieces = self._pieces_of(sizes, order)
        layers = cache.model.num_layers
        embed_s, head_s = cache.stage(pieces[0].stages[0]).embed_s, cache.stage(pieces[-1].stages[-1]).head_s
        if sum(piece.summary.count for piece in pieces) <= layers:
            join = self.join
            joins = [join(pieces[i], pieces[i + 1]) for i in range(len(pieces) - 1)]
            return runs_lower_bound([piece.summary for piece in pieces], joins, embed_s, head_s, layers, self.micro,
                                    self.max_stages)
        return self._dropped_bound(pieces)

    def _dropped_bound(self, pieces: list[Piece]) -> float:
        """`bounds.stages_lower_bound` of the stages kept when the slowest are dropped (as `_assemble` keeps
        them: the L fastest, ties to the earlier), summed piece by piece (`_Kept`)."""
        layers = self.cache.model.num_layers
        if layers > self.max_stages:
            return INFEASIBLE
        speed = sorted([t for piece in pieces for t in piece.speeds])
        cut = speed[layers - 1]
        return _Kept(self.cache, pieces, cut, layers - bisect_left(speed, cut)).bound(self)

    def _bounds_of(self, trials: list[tuple[dict[int, tuple[int, ...]], tuple[int, ...]]], keys: list[tuple]
                   ) -> list[float]:
        """`bound` of each trial; trials that share their group sizes (the same dict) and differ in block order
        share the order-free totals (`_Totals`)."""
        seen, memo, totals = self._seen, self._bounds, {}
        layers = self.cache.model.num_layers
        out: list[float] = []
        for (sizes, order), key in zip(trials, keys, strict=True):
            hit = seen.get(key)
            if hit is not None:
                out.append(hit[0])
                continue
            known = memo.get(key)
            if known is None:
                found = totals.get(id(sizes))
                if found is None:
                    found = totals[id(sizes)] = _Totals(self, sizes)
                known = memo[key] = found.bound(order) if found.count <= layers else self._bound(key, sizes, order)
            out.append(known)
        return out

    def unit_ranked(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...], block: int,
                    options: list[tuple[int, ...]], bar: float) -> list[tuple[float, dict[int, tuple[int, ...]]]]:
        """`ranked` (keep 1) of the trials that give block `block` each of `options` in the trial (`sizes`,
        `order`), as (cost, sizes); their bounds come from the other blocks' totals, summed once."""
        trials = [({**sizes, block: option}, order) for option in options]
        keys = [(tuple(trial.items()), order) for trial, _ in trials]
        bounds = _UnitBounds(self, sizes, order, block).bounds(trials, keys)
        return [(value, trials[j][0]) for value, j in self.ranked(trials, 1, bar, bounds, keys)]

    def ranked(self, trials: list[tuple[dict[int, tuple[int, ...]], tuple[int, ...]]], keep: int, bar: float,
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
        for j in sorted(range(len(trials)), key=lambda j: (bounds[j], j)):
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


class _Kept:
    """The stages of `pieces` (in order) kept when the slowest are dropped: those faster than `cut` (seconds
    per layer) and the first `room` at `cut`; their count, sums of 1 / t, of t and of the links between
    consecutive kept stages, largest one-stage and pair window, fastest t, first and last kept stage (devices,
    t, and the piece when the stage starts / ends it, for `Trials.join`'s memo), and the room left."""

    def __init__(self, cache: CostCache, pieces: list[Piece], cut: float, room: int) -> None:
        p2p = cache.p2p
        count, inverse, total, hops, pace, fastest = 0, 0.0, 0.0, 0.0, 0.0, float("inf")
        first: tuple[Devs, float, Piece | None] | None = None
        last: tuple[Devs, float, Piece | None] | None = None
        for piece in pieces:
            run = piece.summary
            if run.fastest > cut:
                continue
            if run.slowest < cut:  # kept whole
                kept: range | list[int] = range(run.count)
                count += run.count
                inverse += run.inverse
                total += run.total
                hops += run.hops
                pace = max(pace, run.slowest, run.pair)
                fastest = min(fastest, run.fastest)
            else:
                kept = []
                for i, t in enumerate(piece.speeds):
                    if t < cut or (t == cut and room > 0):
                        room -= t == cut
                        kept.append(i)
                if not kept:
                    continue
                for j, i in enumerate(kept):
                    t = piece.speeds[i]
                    count += 1
                    inverse += 1.0 / t
                    total += t
                    pace = max(pace, t)
                    fastest = min(fastest, t)
                    if j:
                        before = kept[j - 1]
                        p = piece.links[before] if before == i - 1 else p2p(piece.stages[before], piece.stages[i])
                        hops += p
                        pace = max(pace, (piece.speeds[before] + t + 2.0 * p) / 2.0)
            head = (piece.stages[kept[0]], piece.speeds[kept[0]], piece if kept[0] == 0 else None)
            if last is None:
                first = head
            else:
                p = _link(cache, last, head)
                hops += p
                pace = max(pace, (last[1] + head[1] + 2.0 * p) / 2.0)
            end = kept[-1]
            last = (piece.stages[end], piece.speeds[end], piece if end == run.count - 1 else None)
        self.count, self.inverse, self.total, self.hops, self.pace, self.fastest = \
            count, inverse, total, hops, pace, fastest
        self.first, self.last, self.room = first, last, room

    def bound(self, owner: Trials, *more: _Kept) -> float:
        """`Trials._dropped_bound` of these kept stages followed by those of `more` (in order)."""
        count, inverse, total, hops, pace, fastest = \
            self.count, self.inverse, self.total, self.hops, self.pace, self.fastest
        first, last = self.first, self.last
        cache = owner.cache
        for part in more:
            if part.first is None:
                continue
            if last is not None:
                p = _link(cache, last, part.first)
                hops += p
                pace = max(pace, (last[1] + part.first[1] + 2.0 * p) / 2.0)
            else:
                first = part.first
            last = part.last
            count += part.count
            inverse += part.inverse
            total += part.total
            hops += part.hops
            pace = max(pace, part.pace)
            fastest = min(fastest, part.fastest)
        assert first is not None and last is not None
        layers = cache.model.num_layers
        return combine(count, first[1], last[1], inverse, total, fastest, pace, hops, cache.stage(first[0]).embed_s,
                       cache.stage(last[0]).head_s, layers, owner.micro)


def _link(cache: CostCache, before: tuple[Devs, float, Piece | None], after: tuple[Devs, float, Piece | None]
          ) -> float:
    """`CostCache.p2p` from stage `before` to stage `after` (memoised by the pieces when they end / start one,
    as `Trials.join`)."""
    if before[2] is None or after[2] is None:
        return cache.p2p(before[0], after[0])
    key = (before[2].serial, after[2].serial)
    found = cache.piece_joins.get(key)
    if found is None:
        found = cache.piece_joins[key] = cache.p2p(before[0], after[0])
    return found


class _Totals:
    """The order-free totals of one group-size choice (every block's piece): stage count, sums of 1 / t, of t
    and of the pieces' inner links, their largest one-stage and pair windows and fastest stage; `bound` adds
    a block order's joins (as `bounds.runs_lower_bound`, in another order of summation)."""

    def __init__(self, trials: Trials, sizes: dict[int, tuple[int, ...]]) -> None:
        self.trials = trials
        self.pieces = pieces = [trials.piece(b, sizes[b]) for b in range(len(trials.blocks))]
        count, inverse, total, hops, pace, fastest = 0, 0.0, 0.0, 0.0, 0.0, float("inf")
        for piece in pieces:
            run = piece.summary
            count += run.count
            inverse += run.inverse
            total += run.total
            hops += run.hops
            pace = max(pace, run.slowest, run.pair)
            fastest = min(fastest, run.fastest)
        self.count, self.inverse, self.total, self.hops, self.pace, self.fastest = \
            count, inverse, total, hops, pace, fastest

    def bound(self, order: tuple[int, ...]) -> float:
        """`Trials._bound` of these sizes in block order `order` (at most as many stages as layers)."""
        owner, pieces = self.trials, self.pieces
        if self.count > owner.max_stages:
            return INFEASIBLE
        pace, hops = self.pace, self.hops
        joins, p2p = owner.cache.piece_joins, owner.cache.p2p
        before = pieces[order[0]]
        for b in order[1:]:
            after = pieces[b]
            key = (before.serial, after.serial)  # `Trials.join`, inlined
            p = joins.get(key)
            if p is None:
                p = joins[key] = p2p(before.stages[-1], after.stages[0])
            hops += p
            pair = (before.summary.last_t + after.summary.first_t + 2.0 * p) / 2.0
            if pair > pace:
                pace = pair
            before = after
        head, tail = pieces[order[0]], pieces[order[-1]]
        stage = owner.cache.stage
        return combine(self.count, head.summary.first_t, tail.summary.last_t, self.inverse, self.total,
                       self.fastest, pace, hops, stage(head.stages[0]).embed_s, stage(tail.stages[-1]).head_s,
                       owner.cache.model.num_layers, owner.micro)


class _UnitBounds:
    """`Trials.bound` of trials that differ from (`sizes`, `order`) only in block `block`'s group sizes: the
    other pieces' totals and the joins between them are summed once, each trial adds its piece and its two
    joins (O(1) a trial instead of O(blocks))."""

    def __init__(self, trials: Trials, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...], block: int) -> None:
        self.trials, self.order = trials, order
        pieces = trials._pieces_of(sizes, order)
        self.at = at = order.index(block)
        self.block, self.pieces = block, pieces
        count, inverse, total, hops, pace, fastest = 0, 0.0, 0.0, 0.0, 0.0, float("inf")
        for k, piece in enumerate(pieces):
            if k == at:
                continue
            run = piece.summary
            count += run.count
            inverse += run.inverse
            total += run.total
            hops += run.hops
            pace = max(pace, run.slowest, run.pair)
            fastest = min(fastest, run.fastest)
        for k in range(len(pieces) - 1):
            if k != at - 1 and k != at:
                p = trials.join(pieces[k], pieces[k + 1])
                hops += p
                pace = max(pace, (pieces[k].summary.last_t + pieces[k + 1].summary.first_t + 2.0 * p) / 2.0)
        self.count, self.inverse, self.total, self.hops, self.pace, self.fastest = \
            count, inverse, total, hops, pace, fastest
        self.speeds: list[float] | None = None  # the other pieces' per-layer seconds, for dropped stages
        self.kept: dict[tuple[int, float, int], _Kept] = {}  # `_side` by (side, cut speed, room)

    def bounds(self, trials: list[tuple[dict[int, tuple[int, ...]], tuple[int, ...]]], keys: list[tuple]
               ) -> list[float]:
        """The bound of each trial (`keys`: their `Trials.key`s; memoised in the Trials object, as
        `Trials.bound`)."""
        owner, pieces = self.trials, self.pieces
        cache, seen, memo = owner.cache, owner._seen, owner._bounds
        layers, last = cache.model.num_layers, len(pieces) - 1
        out: list[float] = []
        for (sizes, _), key in zip(trials, keys, strict=True):
            hit = seen.get(key)
            if hit is not None:
                out.append(hit[0])
                continue
            known = memo.get(key)
            if known is None:
                known = memo[key] = self._one(owner.piece(self.block, sizes[self.block]), key, sizes, cache, layers,
                                              last)
            out.append(known)
        return out

    def _dropped(self, piece: Piece, layers: int) -> float:
        """`Trials._dropped_bound` of the trial with `piece` at the block's place: the kept stages before and
        after it are summed once per cut speed and room (`_Kept`)."""
        owner = self.trials
        if layers > owner.max_stages:
            return INFEASIBLE
        if self.speeds is None:
            self.speeds = [t for k, other in enumerate(self.pieces) if k != self.at for t in other.speeds]
        speed = sorted(self.speeds + list(piece.speeds))
        cut = speed[layers - 1]
        before = self._side(0, cut, layers - bisect_left(speed, cut))
        middle = _Kept(owner.cache, [piece], cut, before.room)
        return before.bound(owner, middle, self._side(1, cut, middle.room))

    def _side(self, side: int, cut: float, room: int) -> _Kept:
        """The kept stages of the pieces before (side 0) or after (side 1) the block's place (memoised)."""
        key = (side, cut, room)
        found = self.kept.get(key)
        if found is None:
            pieces = self.pieces[:self.at] if side == 0 else self.pieces[self.at + 1:]
            found = self.kept[key] = _Kept(self.trials.cache, pieces, cut, room)
        return found

    def _one(self, piece: Piece, key: tuple, sizes: dict[int, tuple[int, ...]], cache: CostCache, layers: int,
             last: int) -> float:
        owner, at, pieces = self.trials, self.at, self.pieces
        run = piece.summary
        count = self.count + run.count
        if count > layers:  # stages dropped
            return self._dropped(piece, layers)
        if count > owner.max_stages:
            return INFEASIBLE
        pace, hops = max(self.pace, run.slowest, run.pair), self.hops + run.hops
        if at > 0:
            before = pieces[at - 1]
            p = owner.join(before, piece)
            hops += p
            pace = max(pace, (before.summary.last_t + run.first_t + 2.0 * p) / 2.0)
        if at < last:
            after = pieces[at + 1]
            p = owner.join(piece, after)
            hops += p
            pace = max(pace, (run.last_t + after.summary.first_t + 2.0 * p) / 2.0)
        head = piece if at == 0 else pieces[0]
        tail = piece if at == last else pieces[last]
        return combine(count, head.summary.first_t, tail.summary.last_t, self.inverse + run.inverse,
                       self.total + run.total, min(self.fastest, run.fastest), pace, hops,
                       cache.stage(head.stages[0]).embed_s, cache.stage(tail.stages[-1]).head_s, layers, owner.micro)


def _kept(speed: list[float], layers: int) -> list[int]:
    """Positions of the `layers` fastest stages (per-layer seconds `speed`), ties to the earlier, in pipeline
    order (as `stages.assemble`): every stage faster than the layers-th speed, then the first at that speed."""
    cut_speed = sorted(speed)[layers - 1]
    room = layers - sum(1 for t in speed if t < cut_speed)
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

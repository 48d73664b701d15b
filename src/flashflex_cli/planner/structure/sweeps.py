"""Summed lower bounds of the structure search's sweeps (`trials.Trials.ranked`'s first bounds).

A sweep's trials share most of their pieces, so what they share is summed once: a unit sweep (one block's
group sizes vary, `UnitBounds`) sums the other pieces and the joins between them, each trial adds its piece
and its two joins (O(1) a trial); an order sweep (`Totals`, the same sizes in several block orders) sums the
order-free totals, each order adds its joins. A trial with more stages than layers keeps its L fastest
(`kept.Kept`), summed piece by piece: a piece kept whole adds its summary, one kept in part its kept stages; in a
unit sweep the pieces before and after the varying block are summed once per cut speed. Every figure is the
one `bounds.runs_lower_bound` / `bounds.stages_lower_bound` sums stage by stage, in another order of
summation (tests/test_planner_bounds.py), so every bound is the same valid lower bound. Seconds per
micro-batch.
"""

from __future__ import annotations

from bisect import bisect_left

from ...cost.schedule import pair_window_s
from ..scoring.cost_cache import CostCache
from .bounds import INFEASIBLE, combine
from .kept import Kept, whole
from .pieces import Piece, Sizes, TrialSpace

Sums = tuple[int, float, float, float, float, float]  # count, sum 1 / t, sum t, inner links, largest window, fastest


def _summed(pieces: list[Piece]) -> Sums:
    """The `Sums` of the pieces' summaries, in order (count, 1 / t, t and links summed, windows and t compared)."""
    count, inverse, total, hops, pace, fastest = 0, 0.0, 0.0, 0.0, 0.0, float("inf")
    for piece in pieces:
        run = piece.summary
        count += run.count
        inverse += run.inverse
        total += run.total
        hops += run.hops
        pace = max(pace, run.slowest, run.pair)
        fastest = min(fastest, run.fastest)
    return count, inverse, total, hops, pace, fastest


class Totals:
    """The order-free totals of one group-size choice (every block's piece): stage count, sums of 1 / t, of t
    and of the pieces' inner links, their largest one-stage and pair windows and fastest stage; `bound` adds
    a block order's joins (as `bounds.runs_lower_bound`, in another order of summation)."""

    def __init__(self, trials: TrialSpace, sizes: Sizes) -> None:
        self.trials = trials
        self.pieces = pieces = [trials.piece(b, sizes[b]) for b in range(len(trials.blocks))]
        self.count, self.inverse, self.total, self.hops, self.pace, self.fastest = _summed(pieces)
        self._cut_room: tuple[float, int] | None = None
        self._parts: dict[tuple[int, int], Kept] = {}  # `_kept_of` by (block, room left; -1 where no tie is)

    def cut_room(self) -> tuple[float, int]:
        """`TrialSpace.cut_room` of these pieces (order-free), computed once."""
        if self._cut_room is None:
            self._cut_room = self.trials.cut_room(self.pieces)
        return self._cut_room

    def dropped_bound(self, order: tuple[int, ...]) -> float:
        """`Trials._dropped_bound` of these sizes in block order `order` (more stages than layers): each piece's kept
        stages (`Kept`) do not depend on the order but through the room left for stages at the cut speed, so they are
        summed once per piece (and room, where it has such a stage) and joined in order."""
        owner = self.trials
        if owner.cache.model.num_layers > owner.max_stages:
            return INFEASIBLE
        cut, room = self.cut_room()
        parts = []
        for b in order:
            part, room = self._kept_of(b, cut, room)
            if part is not None:
                parts.append(part)
        return parts[0].bound(owner, *parts[1:])

    def _kept_of(self, block: int, cut: float, room: int) -> tuple[Kept | None, int]:
        """The kept stages of block `block`'s piece when `room` stages at the cut speed may still be kept (None when
        none is), and the room left after it."""
        piece = self.pieces[block]
        run = piece.summary
        if run.fastest > cut:
            return None, room
        if run.slowest < cut:
            return whole(self.trials.cache, piece), room
        tied = cut in piece.speeds
        key = (block, room if tied else -1)
        found = self._parts.get(key)
        if found is None:
            found = self._parts[key] = Kept(self.trials.cache, [piece], cut, room)
        return (found if found.first is not None else None), (found.room if tied else room)

    def bound(self, order: tuple[int, ...]) -> float:
        """`Trials._bound` of these sizes in block order `order` (at most as many stages as layers)."""
        owner, pieces = self.trials, self.pieces
        if self.count > owner.max_stages:
            return INFEASIBLE
        pace, hops = self.pace, self.hops
        joins, p2p = owner.memo.joins, owner.cache.p2p
        before = pieces[order[0]]
        for b in order[1:]:
            after = pieces[b]
            key = (before.serial, after.serial)  # `TrialSpace.join`, inlined
            p = joins.get(key)
            if p is None:
                p = joins[key] = p2p(before.stages[-1], after.stages[0])
            hops += p
            pair = pair_window_s(before.summary.last_t, after.summary.first_t, p)
            if pair > pace:
                pace = pair
            before = after
        head, tail = pieces[order[0]], pieces[order[-1]]
        return combine(self.count, head.summary.first_t, tail.summary.last_t, self.inverse, self.total,
                       self.fastest, pace, hops, head.embed_s, tail.head_s, owner.cache.model.num_layers, owner.micro)


class UnitBounds:
    """`Trials.bound` of trials that differ from (`sizes`, `order`) only in block `block`'s group sizes: the
    other pieces' totals and the joins between them are summed once, each trial adds its piece and its two
    joins (O(1) a trial instead of O(blocks))."""

    def __init__(self, trials: TrialSpace, sizes: Sizes, order: tuple[int, ...], block: int) -> None:
        self.trials, self.order = trials, order
        pieces = trials._pieces_of(sizes, order)
        self.at = at = order.index(block)
        self.block, self.pieces = block, pieces
        count, inverse, total, hops, pace, fastest = _summed([piece for k, piece in enumerate(pieces) if k != at])
        for k in range(len(pieces) - 1):
            if k != at - 1 and k != at:
                p = trials.join(pieces[k], pieces[k + 1])
                hops += p
                pace = max(pace, pair_window_s(pieces[k].summary.last_t, pieces[k + 1].summary.first_t, p))
        self.count, self.inverse, self.total, self.hops, self.pace, self.fastest = \
            count, inverse, total, hops, pace, fastest
        self.speeds: list[float] | None = None  # the other pieces' per-layer seconds, sorted, for dropped stages
        self.none_kept: float | None = None  # the bound of the trials that keep none of the block's stages
        self.kept: dict[tuple[int, float, int], Kept] = {}  # `_side` by (side, cut speed, room)
        # the layer rooms (`TrialSpace.layer_room`) of the pieces after the block's place and, by stage count, of
        # the pieces before it (`_after_room`, `_before_room`)
        self.after_count = sum(piece.summary.count for piece in pieces[at + 1:])
        self.after_room: int | None = None
        self.before_room: dict[int, int] = {}

    def bounds(self, options: list[tuple[int, ...]], keys: list[tuple]) -> list[float]:
        """The bound of the trial with each of `options` as the block's group sizes (`keys`: their `Trials.key`s;
        memoised in the Trials object, as `Trials.bound`)."""
        owner = self.trials
        cache = owner.cache
        layers, last, block = cache.model.num_layers, len(self.pieces) - 1, self.block
        return owner.memo_bounds(options, keys, lambda option, _key: self._one(
            owner.piece(block, option), cache, layers, last))

    def may_fit(self, option: tuple[int, ...]) -> bool:
        """False when the layers of the trial with `option` as the block's group sizes do not fit in memory
        (`TrialSpace.fits`, from the rooms of the other pieces summed once); True when they do or when stages are
        dropped (not known here)."""
        owner = self.trials
        piece = owner.piece(self.block, option)
        count = self.count + piece.summary.count
        layers = owner.cache.model.num_layers
        if count > layers:
            return True
        last = len(self.pieces) - 1
        return self._after_room() + owner.layer_room(piece, piece.summary.count + self.after_count, self.at == 0,
                                                     self.at == last) + self._before_room(count) >= layers

    def _after_room(self) -> int:
        """The layer rooms of the pieces after the block's place (their depths do not depend on its piece)."""
        if self.after_room is None:
            owner, pieces, last = self.trials, self.pieces, len(self.pieces) - 1
            depth, room = 0, 0
            for k in range(last, self.at, -1):
                depth += pieces[k].summary.count
                room += owner.layer_room(pieces[k], depth, False, k == last)
            self.after_room = room
        return self.after_room

    def _before_room(self, count: int) -> int:
        """The layer rooms of the pieces before the block's place in a trial of `count` stages (memoised)."""
        found = self.before_room.get(count)
        if found is None:
            owner, depth, found = self.trials, count, 0
            for k in range(self.at):
                piece = self.pieces[k]
                found += owner.layer_room(piece, depth, k == 0, False)
                depth -= piece.summary.count
            self.before_room[count] = found
        return found

    def _dropped(self, piece: Piece, layers: int) -> float:
        """`Trials._dropped_bound` of the trial with `piece` at the block's place: the kept stages before and
        after it are summed once per cut speed and room (`Kept`)."""
        owner = self.trials
        if layers > owner.max_stages:
            return INFEASIBLE
        speeds = self._other_speeds()
        if self.keeps_none(piece, layers):  # the trial is the other pieces' L fastest stages, whatever the piece
            if self.none_kept is None:
                cut = speeds[layers - 1]
                before = self._side(0, cut, layers - bisect_left(speeds, cut))
                self.none_kept = before.bound(owner, self._side(1, cut, before.room))
            return self.none_kept
        # the layers-th smallest per-layer time of all stages lies among the other pieces' `layers` smallest and
        # this piece's; the stages faster than it: the others' (bisect) and this piece's
        cut = sorted(speeds[:layers] + list(piece.speeds))[layers - 1]
        faster = bisect_left(speeds, cut) + sum(1 for t in piece.speeds if t < cut)
        before = self._side(0, cut, layers - faster)
        run = piece.summary
        if run.fastest > cut:  # none of its stages kept
            return before.bound(owner, self._side(1, cut, before.room))
        middle = whole(owner.cache, piece) if run.slowest < cut else Kept(owner.cache, [piece], cut, before.room)
        return before.bound(owner, middle, self._side(1, cut, before.room if run.slowest < cut else middle.room))

    def keeps_none(self, piece: Piece, layers: int) -> bool:
        """Whether the trial with `piece` at the block's place keeps none of its stages: the other pieces have `layers`
        stages faster than all of its (the trial is then the same pipeline whatever the piece, when it has more stages
        than layers)."""
        speeds = self._other_speeds()
        return len(speeds) >= layers and piece.summary.fastest > speeds[layers - 1]

    def _other_speeds(self) -> list[float]:
        """The other pieces' per-layer seconds, sorted (computed once)."""
        if self.speeds is None:
            self.speeds = sorted([t for k, other in enumerate(self.pieces) if k != self.at for t in other.speeds])
        return self.speeds

    def _side(self, side: int, cut: float, room: int) -> Kept:
        """The kept stages of the pieces before (side 0) or after (side 1) the block's place (memoised)."""
        key = (side, cut, room)
        found = self.kept.get(key)
        if found is None:
            pieces = self.pieces[:self.at] if side == 0 else self.pieces[self.at + 1:]
            found = self.kept[key] = Kept(self.trials.cache, pieces, cut, room)
        return found

    def _one(self, piece: Piece, cache: CostCache, layers: int, last: int) -> float:
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
            pace = max(pace, pair_window_s(before.summary.last_t, run.first_t, p))
        if at < last:
            after = pieces[at + 1]
            p = owner.join(piece, after)
            hops += p
            pace = max(pace, pair_window_s(run.last_t, after.summary.first_t, p))
        head = piece if at == 0 else pieces[0]
        tail = piece if at == last else pieces[last]
        return combine(count, head.summary.first_t, tail.summary.last_t, self.inverse + run.inverse,
                       self.total + run.total, min(self.fastest, run.fastest), pace, hops, head.embed_s, tail.head_s,
                       layers, owner.micro)

"""The stages of a trial kept when it has more stages than layers, summed piece by piece for its lower bound.

A pipeline with more stages than layers keeps its L fastest (ties to the earlier, as `stage_search.assemble`).
`Kept` sums what `bounds.stages_lower_bound` needs of the kept stages of some pieces in order: a piece kept
whole adds its summary, one kept in part its kept stages; `Kept.bound` joins such runs (the sweeps sum the
pieces before and after a varying block once, `sweeps.UnitBounds`). Seconds per micro-batch.
"""

from __future__ import annotations

from ...cost.schedule import pair_window_s
from ..scoring.cost_cache import CostCache, Devs
from .bounds import combine
from .pieces import Piece, PieceMemo, TrialSpace


class Kept:
    """The stages of `pieces` (in order) kept when the slowest are dropped: those faster than `cut` (seconds
    per layer) and the first `room` at `cut`; their count, sums of 1 / t, of t and of the links between
    consecutive kept stages, largest one-stage and pair window, fastest t, first and last kept stage (devices,
    t, and the piece when the stage starts / ends it, for the memo of joins), and the room left."""

    def __init__(self, cache: CostCache, pieces: list[Piece], cut: float, room: int) -> None:
        p2p = cache.p2p
        count, inverse, total, hops, pace, fastest = 0, 0.0, 0.0, 0.0, 0.0, float("inf")
        first: tuple[Devs, float, Piece | None] | None = None
        last: tuple[Devs, float, Piece | None] | None = None
        for piece in pieces:
            run = piece.summary
            if run.fastest > cut:
                continue
            if run.slowest < cut:  # kept whole: its summary (as `sweeps._summed`)
                count += run.count
                inverse += run.inverse
                total += run.total
                hops += run.hops
                pace = max(pace, run.slowest, run.pair)
                if run.fastest < fastest:
                    fastest = run.fastest
                head, tail = (piece.stages[0], run.first_t, piece), (piece.stages[-1], run.last_t, piece)
            else:
                kept: list[int] = []
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
                        pace = max(pace, pair_window_s(piece.speeds[before], t, p))
                start, end = kept[0], kept[-1]
                head = (piece.stages[start], piece.speeds[start], piece if start == 0 else None)
                tail = (piece.stages[end], piece.speeds[end], piece if end == run.count - 1 else None)
            if last is None:
                first = head
            else:
                p = link(cache, last, head)
                hops += p
                pace = max(pace, pair_window_s(last[1], head[1], p))
            last = tail
        self.count, self.inverse, self.total, self.hops, self.pace, self.fastest = \
            count, inverse, total, hops, pace, fastest
        self.first, self.last, self.room = first, last, room

    def bound(self, owner: TrialSpace, *more: Kept) -> float:
        """`Trials._dropped_bound` of these kept stages followed by those of `more` (in order)."""
        count, inverse, total, hops, pace, fastest = \
            self.count, self.inverse, self.total, self.hops, self.pace, self.fastest
        first, last = self.first, self.last
        cache = owner.cache
        for part in more:
            if part.first is None:
                continue
            if last is not None:
                p = link(cache, last, part.first)
                hops += p
                pace = max(pace, pair_window_s(last[1], part.first[1], p))
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


def link(cache: CostCache, before: tuple[Devs, float, Piece | None], after: tuple[Devs, float, Piece | None]
          ) -> float:
    """`CostCache.p2p` from stage `before` to stage `after` (memoised by the pieces when they end / start one,
    as `TrialSpace.join`)."""
    if before[2] is None or after[2] is None:
        return cache.p2p(before[0], after[0])
    key = (before[2].serial, after[2].serial)
    joins = cache.memo(PieceMemo).joins
    found = joins.get(key)
    if found is None:
        found = joins[key] = cache.p2p(before[0], after[0])
    return found


class KeptMemo(dict[int, "Kept"]):
    """One cache's `Kept` of single pieces kept whole, by piece serial (`whole`)."""


def whole(cache: CostCache, piece: Piece) -> Kept:
    """`Kept` of `piece` alone when every stage of it is kept (the same whatever the cut speed; memoised)."""
    memo = cache.memo(KeptMemo)
    found = memo.get(piece.serial)
    if found is None:
        found = memo[piece.serial] = Kept(cache, [piece], float("inf"), 0)
    return found

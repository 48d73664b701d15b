"""The trial structures of one pipeline's node blocks: the pieces they are made of, and what is known of each.

A trial is a group-size choice per block and a block order (`stage_search.assemble`). Each block cut into groups
of given sizes is a `Piece`: its stages, their per-layer seconds, the transfer seconds between them and their
`bounds.Summary`. The same blocks recur in many searches of one cache, so the pieces' figures are memoised per
cache (`PieceMemo`): by shape (equal node class and local indices, equal link inside the node, equal group
sizes), the pieces themselves by block devices and group sizes, and the transfer seconds where two pieces join
by their serial numbers. A `TrialSpace` is the trials of one search (blocks, micro-batches, most stages): it
assembles a trial's stages from its pieces exactly as `stage_search.assemble` does (a trial with more stages than
layers keeps its L fastest, ties to the earlier), reads their stage terms and links from the pieces, and keeps
what is known of each trial by key: its exact cost once evaluated, else a lower bound. All figures in seconds
per micro-batch.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..scoring.cost_cache import CostCache, Devs
from ..scoring.pipeline_score import PipeEval
from ..space.tp_groups import cut
from .bounds import Summary

Block = tuple[int, list[int]]
NO_ROOM = -(1 << 40)  # a piece with a stage that can hold no layer: no sum of rooms reaches L
Sizes = dict[int, tuple[int, ...]]
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
    rooms: dict[tuple[int, bool, bool], tuple[int, tuple[int, ...]]]  # `TrialSpace._room_caps`'s memo (equal
    # shapes share it)
    keys: tuple[int, ...]  # the stages' `CostCache.stage_key`s
    node: int  # the node of its block
    serial: int  # its number among the cache's pieces (`PieceMemo.by_block`), the key of its joins


class PieceMemo:
    """One cache's pieces: their figures by shape (`figures`), the pieces by (block devices, group sizes)
    (`by_block`), and the transfer seconds from one piece's last stage to another's first by their serial
    numbers (`joins`)."""

    __slots__ = ("figures", "by_block", "joins")

    def __init__(self) -> None:
        self.figures: dict[tuple, tuple] = {}
        self.by_block: dict[tuple, Piece] = {}
        self.joins: dict[tuple[int, int], float] = {}


class TrialSpace:
    """The trials over `blocks` for a pipeline of `micro` micro-batches and at most `max_stages` stages: their
    pieces, stages, links and stage terms, and the exact cost or a lower bound of each trial known so far."""

    def __init__(self, cache: CostCache, blocks: list[Block], micro: int, max_stages: int) -> None:
        self.cache, self.blocks, self.micro, self.max_stages = cache, blocks, micro, max_stages
        self.memo = cache.memo(PieceMemo)
        self._pieces: list[dict[tuple[int, ...], Piece]] = [{} for _ in blocks]  # by block, by group sizes
        self._seen: dict[tuple, tuple[float, PipeEval]] = {}  # exact cost and evaluation by trial key
        self._bounds: dict[tuple, float] = {}  # lower bound by trial key

    def piece(self, block: int, sizes: tuple[int, ...]) -> Piece:
        """Block `block` (position in `blocks`) cut into consecutive groups of `sizes` (local-index order)."""
        found = self._pieces[block].get(sizes)
        if found is None:
            found = self._pieces[block][sizes] = self._new_piece(block, sizes)
        return found

    def _new_piece(self, block: int, sizes: tuple[int, ...]) -> Piece:
        """`piece`, from the cache's pieces (the same block devices recur in many searches) or built."""
        cache, memo = self.cache, self.memo
        devs = self.blocks[block][1]
        whole = (tuple(devs), sizes)
        found = memo.by_block.get(whole)
        if found is None:
            parts = cut(devs, sizes)
            # equal blocks (node class, local indices) cut equally cost the same, in every search of the cache
            node = self.blocks[block][0]
            shape = (cache.stage_key(whole[0]), cache.graph.node_bw_rows[node][node], sizes)
            known = memo.figures.get(shape)
            if known is None:
                stage, p2p, capacity = cache.stage, cache.p2p, cache.capacity
                speeds = tuple(stage(st).layer_s for st in parts)
                links = tuple(p2p(parts[j], parts[j + 1]) for j in range(len(parts) - 1))
                groups = tuple((cache.cap_row(len(st), capacity(st)), len(st), capacity(st)) for st in parts)
                known = memo.figures[shape] = (speeds, links, Summary.of(speeds, links), groups,
                                               stage(parts[0]).embed_s, stage(parts[-1]).head_s, {},
                                               tuple(cache.stage_key(st) for st in parts))
            found = memo.by_block[whole] = Piece(tuple(parts), *known, node, len(memo.by_block))
        return found

    def _pieces_of(self, sizes: Sizes, order: tuple[int, ...]) -> list[Piece]:
        """The trial's pieces in block order."""
        tables, out = self._pieces, []
        for b in order:
            found = tables[b].get(sizes[b])
            out.append(self.piece(b, sizes[b]) if found is None else found)
        return out

    def stages(self, sizes: Sizes, order: tuple[int, ...]) -> tuple[Devs, ...]:
        """The trial's stages, exactly as `stage_search.assemble` builds them."""
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
        pieces' serial numbers."""
        key = (before.serial, after.serial)
        joins = self.memo.joins
        found = joins.get(key)
        if found is None:
            found = joins[key] = self.cache.p2p(before.stages[-1], after.stages[0])
        return found

    def _links(self, pieces: list[Piece], stages: Sequence[Devs], keep: list[int] | None) -> list[float]:
        """Transfer seconds between consecutive `stages` (`CostCache.p2p`), the pieces' stages, or when some
        were dropped (`keep` not None), the ones kept (a pair that was adjacent keeps its link)."""
        joins, p2p = self.memo.joins, self.cache.p2p
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

    def stage_terms(self, pieces: list[Piece], count: int) -> tuple[list[float], list[float], list[int]]:
        """`pipeline_score.stage_terms` of the stages of `pieces` (all kept, `count` of them) from the pieces'
        figures."""
        return self._terms_and_room(pieces, count)[:3]  # type: ignore[return-value]

    def _terms_and_room(self, pieces: Sequence[Piece], count: int
                        ) -> tuple[list[float], list[float], list[int], int]:
        """`stage_terms` and the pieces' layer rooms summed (`layer_room`): the layers fit exactly when it is at least
        L."""
        per_layer: list[float] = []
        caps: list[int] = []
        depth, room, last = count, 0, len(pieces) - 1
        for k, piece in enumerate(pieces):
            per_layer += piece.speeds
            found = piece.rooms.get((depth, k == 0, k == last))  # `_room_caps`, inlined (the hot path)
            if found is None:
                found = self._room_caps(piece, depth, k == 0, k == last)
            caps += found[1]
            room += found[0]
            depth -= piece.summary.count
        extra = [0.0] * count
        if count == 1:
            extra[0] = pieces[0].embed_s + pieces[-1].head_s
        else:
            extra[0], extra[-1] = pieces[0].embed_s, pieces[-1].head_s
        return per_layer, extra, caps, room

    def _room_caps(self, piece: Piece, depth: int, first: bool, last: bool) -> tuple[int, tuple[int, ...]]:
        """(`layer_room`, the caps `stage_terms` gives the piece's stages) of `piece` at `depth` (memoised)."""
        key = (depth, first, last)
        found = piece.rooms.get(key)
        if found is None:
            cache = self.cache
            layers, end, room, caps = cache.model.num_layers, len(piece.groups) - 1, 0, []
            for j, (row, tp, capacity) in enumerate(piece.groups):
                head, tail = first and j == 0, last and j == end
                if head:
                    cap = cache.max_layers(tp, True, tail, 1 if tail else depth, capacity)
                elif tail:
                    cap = cache.max_layers(tp, False, True, 1, capacity)
                else:
                    cap = row[depth - j]
                    if cap is None:
                        cap = cache.middle_cap(row, tp, capacity, depth - j)
                caps.append(cap)
                room += cap if cap < layers else layers
            found = piece.rooms[key] = (room if min(caps) >= 1 else NO_ROOM, tuple(caps))
        return found

    def layer_room(self, piece: Piece, depth: int, first: bool, last: bool) -> int:
        """How many layers the stages of `piece` can hold in memory, each at most L, when its first stage is
        `depth` stages from the pipeline's end (in flight there: `depth` micro-batches) and it starts (`first`) /
        ends (`last`) the pipeline: the caps `stage_terms` gives them, summed; `NO_ROOM` when one of them holds none.
        A trial's layers fit (`split_layers` finds a split) exactly when its pieces' rooms sum to L or more."""
        return self._room_caps(piece, depth, first, last)[0]

    def fits(self, pieces: Sequence[Piece]) -> bool:
        """Whether the layers fit in the memory of the stages of `pieces` in this order (all of them kept): the
        condition `split_layers` checks first (`layer_room`)."""
        depth = sum(piece.summary.count for piece in pieces)
        room, last = 0, len(pieces) - 1
        for k, piece in enumerate(pieces):
            room += self.layer_room(piece, depth, k == 0, k == last)
            depth -= piece.summary.count
        return room >= self.cache.model.num_layers

    def shape(self, pieces: Sequence[Piece]) -> tuple:
        """`pipeline_score.shape_key` of the stages of `pieces` (all kept), from the pieces' figures."""
        bw = self.cache.graph.node_bw_rows
        keys: tuple[int, ...] = ()
        links: list[float] = []
        before = -1
        for piece in pieces:
            if before >= 0:
                links.append(bw[before][piece.node] if before != piece.node else -1.0)
            keys += piece.keys
            links += [-1.0] * (len(piece.keys) - 1)  # the stages of a block share its node
            before = piece.node
        return keys, tuple(links)

    def cut_room(self, pieces: Sequence[Piece]) -> tuple[float, int]:
        """The per-layer seconds of the L-th fastest stage of `pieces` (L layers) and how many stages at exactly
        that speed are kept (the L fastest, ties to the earlier)."""
        return cut_room([t for piece in pieces for t in piece.speeds], self.cache.model.num_layers)

    @staticmethod
    def key(sizes: Sizes, order: tuple[int, ...]) -> tuple:
        """The memo key of a trial (dicts in one key order: at worst a miss)."""
        return tuple(sizes.items()), order

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


def cut_room(speed: list[float], layers: int) -> tuple[float, int]:
    """The `layers`-th smallest of `speed` (per-layer seconds) and how many stages at exactly that speed are
    kept when the `layers` fastest are (ties to the earlier)."""
    ordered = sorted(speed)
    cut_speed = ordered[layers - 1]
    return cut_speed, layers - bisect_left(ordered, cut_speed)


def _kept(speed: list[float], layers: int) -> list[int]:
    """Positions of the `layers` fastest stages (per-layer seconds `speed`), ties to the earlier, in pipeline
    order (as `stage_search.assemble`): every stage faster than the layers-th speed, then the first at that
    speed."""
    cut_speed, room = cut_room(speed, layers)
    keep = []
    for s, t in enumerate(speed):
        if t < cut_speed:
            keep.append(s)
        elif t == cut_speed and room > 0:
            keep.append(s)
            room -= 1
    return keep

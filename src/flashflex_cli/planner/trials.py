"""Trial structures of one pipeline's node blocks, evaluated only when they might win.

A trial is a group-size choice per block and a block order (`stages.assemble`). Each block cut into
groups of given sizes is a `Piece`, built once per search: its stages, their per-layer seconds, the
transfer seconds between them and their `bounds.Summary`. A trial is then bounded from its pieces and the
transfers where they join (O(blocks)); only a trial whose bound is below the best so far is assembled and
evaluated exactly (`pipeline.evaluate_pipeline`). A trial with more stages than layers drops its slowest
stages (as `stages.assemble` does) and is bounded stage by stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from .bounds import Summary, cannot_beat, runs_lower_bound, stages_lower_bound
from .fastcost import CostCache, Devs
from .pipeline import PipeEval, evaluate_pipeline

Block = tuple[int, list[int]]


@dataclass(frozen=True)
class Piece:
    """One block cut into TP groups: the groups (stage order), one layer's seconds on each, the transfer
    seconds between consecutive groups, and their summary."""

    stages: tuple[Devs, ...]
    speeds: tuple[float, ...]
    links: tuple[float, ...]
    summary: Summary


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
            devs, start, parts = self.blocks[block][1], 0, []
            for size in sizes:
                parts.append(tuple(devs[start:start + size]))
                start += size
            cache = self.cache
            # equal blocks (node class, local indices) cut equally cost the same, in every search of the cache
            node = self.blocks[block][0]
            shape = (cache.stage_key(tuple(devs)), cache.graph.node_bw_rows[node][node], sizes)
            known = cache.piece_memo.get(shape)
            if known is None:
                stage, p2p = cache.stage, cache.p2p
                speeds = tuple(stage(st).layer_s for st in parts)
                links = tuple(p2p(parts[j], parts[j + 1]) for j in range(len(parts) - 1))
                known = cache.piece_memo[shape] = (speeds, links, Summary.of(speeds, links))
            found = self._pieces[block][sizes] = Piece(tuple(parts), *known)
        return found

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
        speed = [t for piece in pieces for t in piece.speeds]
        # the `layers` fastest, ties to the earlier, in pipeline order (as `stages.assemble`): every stage
        # faster than the layers-th speed, then the first stages at that speed
        cut_speed = sorted(speed)[layers - 1]
        room = layers - sum(1 for t in speed if t < cut_speed)
        keep = []
        for s, t in enumerate(speed):
            if t < cut_speed:
                keep.append(s)
            elif t == cut_speed and room > 0:
                keep.append(s)
                room -= 1
        return tuple([stages[s] for s in keep]), keep

    def _links(self, pieces: list[Piece], stages: tuple[Devs, ...], keep: list[int] | None) -> list[float]:
        """Transfer seconds between consecutive `stages` (`CostCache.p2p`), the pieces' stages, or when some
        were dropped (`keep` not None), the ones kept."""
        p2p = self.cache.p2p
        if keep is not None:
            return [p2p(stages[s], stages[s + 1]) for s in range(len(stages) - 1)]
        raw: list[float] = []
        for i, piece in enumerate(pieces):
            if i:
                raw.append(p2p(pieces[i - 1].stages[-1], piece.stages[0]))
            raw.extend(piece.links)
        return raw

    def cost(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...]) -> tuple[float, PipeEval]:
        """The trial's exact amortised seconds per micro-batch (`amortised`) and its evaluation (memoised)."""
        key = (tuple(sizes.items()), order)  # dicts in one key order: at worst a miss
        hit = self._seen.get(key)
        if hit is None:
            pieces = self._pieces_of(sizes, order)
            stages, keep = self._assemble(pieces)
            pipe = evaluate_pipeline(self.cache, stages, lambda: self._links(pieces, stages, keep))
            hit = self._seen[key] = (amortised(pipe, self.micro, self.max_stages), pipe)
        return hit

    def bound(self, sizes: dict[int, tuple[int, ...]], order: tuple[int, ...]) -> float:
        """A lower bound on `cost` (the exact figure when already known)."""
        key = (tuple(sizes.items()), order)  # dicts in one key order: at worst a miss
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
            joins = [cache.p2p(pieces[i].stages[-1], pieces[i + 1].stages[0]) for i in range(len(pieces) - 1)]
            return runs_lower_bound([piece.summary for piece in pieces], joins, embed_s, head_s, layers, self.micro,
                                    self.max_stages)
        # the slowest stages are dropped: many trials keep the same stages (memoised), else bound them
        stages, keep = self._assemble(pieces)
        hit = cache.pipe_memo.get(stages)
        if hit is not None:
            self._seen[key] = (amortised(hit, self.micro, self.max_stages), hit)  # type: ignore[arg-type]
            return self._seen[key][0]
        assert keep is not None
        speed = [t for piece in pieces for t in piece.speeds]
        return stages_lower_bound([speed[s] for s in keep], self._links(pieces, stages, keep),
                                  cache.stage(stages[0]).embed_s, cache.stage(stages[-1]).head_s, layers, self.micro,
                                  self.max_stages)

    def ranked(self, trials: list[tuple[dict[int, tuple[int, ...]], tuple[int, ...]]], keep: int, bar: float
               ) -> list[tuple[float, int]]:
        """The `keep` best trials strictly below `bar` as (cost, position), by (cost, position).

        Trials are evaluated best-first by lower bound; once a bound shows that a trial costs more than the
        keep-th best found so far (or `bar`), it and every trial after it in that order are skipped."""
        bounds = [self.bound(sizes, order) for sizes, order in trials]
        found: list[tuple[float, int]] = []
        for j in sorted(range(len(trials)), key=lambda j: (bounds[j], j)):
            limit = found[keep - 1][0] if len(found) >= keep else bar
            if limit < float("inf") and cannot_beat(bounds[j], limit):
                break  # (with nothing below inf yet, every trial is evaluated: `search._nothing_fits` reads them)
            value = self.cost(*trials[j])[0]
            if value < bar:
                found.append((value, j))
                found.sort()
        return found[:keep]



def amortised(pipe: PipeEval, micro: int, max_stages: int) -> float:
    """Seconds per micro-batch when the pipeline runs `micro` micro-batches (inf when it does not fit, or
    has more stages than the `max_stages` micro-batches the whole batch has: 1F1B needs one per stage)."""
    if not pipe.ok or pipe.num_stages > max_stages:
        return float("inf")
    m = max(micro, pipe.num_stages)
    return (pipe.fill_s + (m - 1) * pipe.pace_s) / m

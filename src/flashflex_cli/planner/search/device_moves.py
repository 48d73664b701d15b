"""Device-level refinement moves: shed devices from a TP group into another pipeline, swap two devices.

`refine` moves whole TP groups; these moves change the groups themselves, across pipelines:

- shed: take the fewest devices k >= 1 out of a group of degree tp > 1 such that tp - k is a degree the
  model supports (`ModelSpec.supports_tp`), and give them to another pipeline, either as new stages (cut
  into the largest supported degrees, placed next to their node's stages) or merged into one of its
  groups in the same fast-link island when the merged degree is supported;
- swap: exchange one device of a group with one device of a group of another pipeline (at least one of
  the two groups has tp > 1), when both new groups stay inside one island.

Every move keeps the level-2 rules (a group inside one node and one fast-link island, a supported
degree). Moves come as change sets {pipeline index: its new stages}, in a fixed order given the
pipeline order; devices that would give equal groups (same island, same speed and memory) are tried once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ..scoring.cost_cache import CostCache, Devs
from ..space.tp_groups import chunk, tp_degrees

Changes = dict[int, tuple[Devs, ...]]


def place(cache: CostCache, stages: tuple[Devs, ...], new: Devs) -> tuple[Devs, ...]:
    """Insert a stage next to the stages of its island, else keep island blocks in ascending order."""
    island = cache.graph.island
    target = int(island[new[0]])
    same = [s for s, st in enumerate(stages) if int(island[st[0]]) == target]
    if same:
        pos = same[-1] + 1
    else:
        pos = next((s for s, st in enumerate(stages) if int(island[st[0]]) > target), len(stages))
    return stages[:pos] + (new,) + stages[pos:]


def shed_count(cache: CostCache, tp: int) -> int:
    """Fewest devices to take out of a group of degree `tp` so that the rest has a supported degree."""
    return next(k for k in range(1, tp) if cache.model.supports_tp(tp - k))


def _distinct(cache: CostCache, devs: Sequence[int]) -> list[int]:
    """One device per (island, FLOP/s, memory) among `devs`, first by local index."""
    g = cache.graph
    seen: set[tuple] = set()
    out = []
    for i in devs:
        key = (int(g.island[i]), float(g.flops[i]), float(g.memory[i]))
        if key not in seen:
            seen.add(key)
            out.append(i)
    return out


def _shed_options(cache: CostCache, stage: Devs) -> list[tuple[Devs, Devs]]:
    """(kept, taken) splits of a group: one distinct device at a time when k = 1, else the last or first k."""
    k = shed_count(cache, len(stage))
    if k == 1:
        return [(tuple(i for i in stage if i != a), (a,)) for a in _distinct(cache, stage)]
    options = [(stage[:-k], stage[-k:]), (stage[k:], stage[:k])]
    return list(dict.fromkeys(options))


def _one_island(cache: CostCache, devs: Sequence[int]) -> bool:
    island = cache.graph.island
    return len({int(island[i]) for i in devs}) == 1


def shed_moves(cache: CostCache, stages_by_pipe: Sequence[tuple[Devs, ...]], p: int,
               partners: Sequence[int]) -> Iterator[Changes]:
    """Moves taking devices out of pipeline `p`'s groups into each partner pipeline (module docstring)."""
    g = cache.graph
    mine = stages_by_pipe[p]
    for s, stage in enumerate(mine):
        if len(stage) < 2:
            continue
        for kept, taken in _shed_options(cache, stage):
            rest = mine[:s] + (kept,) + mine[s + 1:]
            degrees = tp_degrees(cache.model, len(taken))
            pieces = chunk(list(taken), max(degrees), degrees)
            for q in partners:
                theirs = stages_by_pipe[q]
                added = theirs
                for piece in pieces:
                    added = place(cache, added, piece)
                yield {p: rest, q: added}
                for t, other in enumerate(theirs):
                    if int(g.island[other[0]]) != int(g.island[taken[0]]):
                        continue
                    if not cache.model.supports_tp(len(other) + len(taken)):
                        continue
                    merged = tuple(sorted(other + taken))
                    yield {p: rest, q: theirs[:t] + (merged,) + theirs[t + 1:]}


def swap_moves(cache: CostCache, stages_by_pipe: Sequence[tuple[Devs, ...]], p: int,
               partners: Sequence[int]) -> Iterator[Changes]:
    """Moves exchanging one device of a group of pipeline `p` with one of a partner's group."""
    g = cache.graph
    mine = stages_by_pipe[p]
    for s, stage in enumerate(mine):
        for q in partners:
            theirs = stages_by_pipe[q]
            for t, other in enumerate(theirs):
                if len(stage) < 2 and len(other) < 2:
                    continue  # a whole-group swap: refine's own move
                for a in _distinct(cache, stage):
                    for b in _distinct(cache, other):
                        if int(g.island[a]) == int(g.island[b]) and g.flops[a] == g.flops[b] \
                                and g.memory[a] == g.memory[b]:
                            continue  # equal devices: nothing changes but the names
                        new_s = tuple(sorted(tuple(i for i in stage if i != a) + (b,)))
                        new_t = tuple(sorted(tuple(i for i in other if i != b) + (a,)))
                        if _one_island(cache, new_s) and _one_island(cache, new_t):
                            yield {p: mine[:s] + (new_s,) + mine[s + 1:], q: theirs[:t] + (new_t,) + theirs[t + 1:]}

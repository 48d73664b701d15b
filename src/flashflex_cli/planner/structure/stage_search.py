"""Level 2: split one pipeline's devices into ordered stages (TP groups).

Rules: a TP group never straddles a node (the links between nodes are the slow ones, Holmes arXiv 2312.03549: keep
TP on the fastest fabric) nor a slow link inside one (it stays in one fast-link island, `islands.device_islands`;
a node without measured intra-node pairs is one island); its degree d is any value the model supports
(`space.tp_groups`). Stages of one island stay contiguous in the pipeline (a "block"; a node is one block unless
it has several islands), so a pipeline hop crosses a node or island boundary only between blocks. The search:
first every node class (each island of it) picks one degree (its devices cut into groups of that degree in
local-index order, a remainder r into the largest supported degrees <= r), under every block order for up to 3
blocks, else four (node order, memory descending -- stage 0 keeps the most micro-batches in flight and holds the
embedding --, speed descending and ascending); then coordinate descent lets each block pick its own mix of group
sizes (any partition of its devices into supported degrees, e.g. TP 1 + TP 2 + TP 1) and re-tries the block orders
(every permutation up to 4 blocks), until no change helps (at most 3 rounds). Where no starting point fits in
memory on a cluster of at most 32 devices, the descent starts from every one of them (when the devices can hold the
model's state at all): a node at TP 1 beside one at TP 2 may fit where one degree per class does not. Clusters of at most 32 devices get a
more thorough search: every order of a block's group sizes, and descent from the 3 best starting points (pipelines
of up to 4 blocks). A structure is scored by its time per micro-batch at the pipeline's expected share of the
batch; the structure found for a group is memoised per cache (`StructureMemo`) for every group of equal shape. A
pipeline with more stages than layers drops its slowest stages (their devices go unused). Each sweep of the
descent (one block's options, or the block orders) ends at the first of its cheapest trials when that one beats
the current structure, so it is searched best-first by an exact lower bound (`trials.Trials.ranked`, `bounds`): a
trial whose bound reaches the best found is never evaluated, and the result is the one the plain sweep finds
(tests/test_planner_bounds.py). With `descent=False` the best start is the structure (FlashFlex's level 2 alone):
the quick first pass over a large cluster's partitions (`search.collect`), memoised apart from the full search.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

from ..scoring.cost_cache import CostCache, Devs
from ..scoring.feasibility import holds_model_state
from ..scoring.pipeline_score import PipeEval, evaluate_pipeline
from ..space.tp_groups import MAX_OPTIONS, chunk_sizes, cut, size_options, tp_degrees
from .trials import Trials

MAX_OPTIONS_THOROUGH = 16
MAX_BLOCK_DESCENT = 16
MAX_ROUNDS = 3
STARTS = 3
THOROUGH_DEVICES = 32  # clusters up to this size get the multi-start, all-orders search
Sizes = dict[int, tuple[int, ...]]
Structure = tuple[Sizes, tuple[int, ...]]  # group sizes by block position, block order


class StructureMemo(dict[tuple, "Structure | None"]):
    """One cache's structures found by `best_pipeline`, by group signature (None: nothing fits)."""


def node_blocks(cache: CostCache, group: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(node index, devices of `group` in one fast-link island of that node, by local index), one block per
    island (`graph.island`), nodes ascending: TP groups are cut inside a block, so never across a slow link."""
    g = cache.graph
    blocks: dict[int, list[int]] = {}
    for i in sorted(group):
        blocks.setdefault(int(g.island[i]), []).append(i)
    return [(int(g.node[devs[0]]), devs) for _, devs in sorted(blocks.items())]


def assemble(cache: CostCache, blocks: list[tuple[int, list[int]]], sizes: dict[int, tuple[int, ...]],
             order: Sequence[int],
             cuts: dict[tuple[int, tuple[int, ...]], tuple[list[Devs], list[float]]] | None = None
             ) -> tuple[Devs, ...]:
    """Stages of a pipeline: block b cut into groups of `sizes[b]`, blocks in `order` (block positions).

    A pipeline with more stages than layers drops its slowest stages. `cuts`: a memo of the blocks' cuts
    and their stages' per-layer seconds (by block position and sizes) for repeated calls on the same blocks."""
    stages: list[Devs] = []
    speed: list[float] = []
    stage = cache.stage
    for b in order:
        key = (b, sizes[b])
        found = None if cuts is None else cuts.get(key)
        if found is None:
            part = cut(blocks[b][1], sizes[b])
            found = (part, [stage(st).layer_s for st in part])
            if cuts is not None:
                cuts[key] = found
        stages.extend(found[0])
        speed.extend(found[1])
    layers = cache.model.num_layers
    if len(stages) > layers:
        keep = sorted(heapq.nsmallest(layers, range(len(stages)), key=lambda s: (speed[s], s)))
        stages = [stages[s] for s in keep]
    return tuple(stages)


def block_orders(cache: CostCache, blocks: list[tuple[int, list[int]]], every: bool) -> list[tuple[int, ...]]:
    """Orders of node blocks: node order, memory descending, speed descending, speed ascending; with
    `every`, all permutations instead when there are at most 4 blocks."""
    g = cache.graph
    count = len(blocks)
    if every and count <= 4:
        return list(itertools.permutations(range(count)))
    memory = [min(g.memory[i] for i in devs) for _, devs in blocks]
    speed = [min(g.flops[i] for i in devs) for _, devs in blocks]
    orders = [tuple(range(count)),
              tuple(sorted(range(count), key=lambda b: (-memory[b], b))),
              tuple(sorted(range(count), key=lambda b: (-speed[b], b))),
              tuple(sorted(range(count), key=lambda b: (speed[b], b)))]
    return list(dict.fromkeys(orders))


def best_pipeline(cache: CostCache, group: Sequence[int], micro_estimate: int,
                  max_stages: int | None = None, descent: bool = True) -> PipeEval | None:
    """The best stage structure for one pipeline's devices (see module docstring); None if none fits.
    `descent=False`: the best start, without the coordinate descent."""
    g = cache.graph
    micro_estimate = bucket(micro_estimate)
    blocks = node_blocks(cache, group)
    nodes = [node for node, _ in blocks]
    local = g.local_list
    signature = (tuple((g.node_class[node], tuple([local[i] for i in devs])) for node, devs in blocks),
                 g.node_bw_key(nodes), micro_estimate, max_stages, descent)
    memo = cache.memo(StructureMemo)
    if signature in memo:  # an equal group elsewhere in the cluster: reuse its structure
        found = memo[signature]
        if found is None:
            return None
        pipe = evaluate_pipeline(cache, assemble(cache, blocks, found[0], found[1]))
        return pipe if pipe.ok else None
    result = _search_structure(cache, blocks, micro_estimate, max_stages or cache.model.num_layers, descent)
    memo[signature] = None if result is None else result[1]
    return None if result is None else result[0]


def bucket(micro: int) -> int:
    """Round a micro-batch estimate to a quarter-octave grid (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, ...),
    so groups of equal shape with slightly different batch shares share one structure search."""
    if micro <= 8:
        return max(1, micro)
    return int(round(2 ** (round(math.log2(micro) * 4) / 4)))


def _search_structure(cache: CostCache, blocks: list[tuple[int, list[int]]], micro_estimate: int, max_stages: int,
                      descent: bool = True) -> tuple[PipeEval, tuple[Sizes, tuple[int, ...]]] | None:
    g = cache.graph
    largest = max(len(devs) for _, devs in blocks)
    degrees = tp_degrees(cache.model, largest)
    thorough = cache.graph.size <= THOROUGH_DEVICES
    orders = block_orders(cache, blocks, every=len(blocks) <= 3)
    trials = Trials(cache, blocks, micro_estimate, max_stages)
    inf = float("inf")

    # 1. one degree per node class (FlashFlex's level 2), under the block orders; the best `used` starts by
    #    (cost, position) go on (`Trials.ranked` skips the ones a lower bound shows cannot be among them)
    used = STARTS if descent and thorough and len(blocks) <= 4 else 1
    by_degree = [{b: tuple(chunk_sizes(len(devs), degree, degrees)) for b, (_, devs) in enumerate(blocks)}
                 for degree in degrees]
    tried = [(sizes, order) for sizes in by_degree for order in orders]
    starts = [(cost, *tried[j]) for cost, j in trials.ranked(tried, used, inf)]
    if not starts:
        # no start fits in memory; one that gives each block its own group sizes may (a node at TP 1 beside one
        # at TP 2), so on a small cluster whose devices can hold the model's state the descent starts from every
        # one of them (on a large one, many groups fit no start, and the other groups' candidates stand in)
        if not thorough or not holds_model_state(cache, [i for _, devs in blocks for i in devs]):
            return None
        starts = [(inf, *trial) for trial in tried]
    if not descent:
        cost, sizes, order = starts[0]
        return None if cost == inf else (trials.cost(sizes, order)[1], (sizes, order))
    options = [size_options(len(devs), degrees, MAX_OPTIONS_THOROUGH if thorough else MAX_OPTIONS, every=thorough)
               for _, devs in blocks]
    all_orders = block_orders(cache, blocks, every=True)
    # 2. from the best few starts, coordinate descent: each block (or each class, for long pipelines) picks
    #    its own group sizes, then the block order is re-tried; the best local optimum wins
    classes = sorted({g.node_class[node] for node, _ in blocks})
    units = [[b] for b in range(len(blocks))] if len(blocks) <= MAX_BLOCK_DESCENT else \
        [[b for b, (node, _) in enumerate(blocks) if g.node_class[node] == c] for c in classes]
    units = [u for u in units if all(len(blocks[b][1]) == len(blocks[u[0]][1]) for b in u)]
    best: tuple[float, Sizes, tuple[int, ...]] | None = None
    for cost, sizes, order in starts:
        current = (cost, sizes, order)
        # where each sweep (a unit's, or the orders' as -1) last ended: swept again from there, it tries the same
        # trials against the cost of their cheapest, so it finds nothing strictly better and is skipped
        ended: dict[int, tuple] = {}
        for _ in range(MAX_ROUNDS):
            before = current[0]
            # taking every strictly better option in turn ends at the first of the cheapest: `ranked` finds it
            for u, unit in enumerate(units):
                if ended.get(u) == trials.key(current[1], current[2]):
                    continue
                if len(unit) == 1:
                    for value, trial in trials.unit_ranked(current[1], current[2], unit[0], options[unit[0]],
                                                           current[0]):
                        current = (value, trial, current[2])
                else:
                    tried = [({**current[1], **{b: option for b in unit}}, current[2])
                             for option in options[unit[0]]]
                    for value, j in trials.ranked(tried, 1, current[0]):
                        current = (value, *tried[j])
                ended[u] = trials.key(current[1], current[2])
            if ended.get(-1) != trials.key(current[1], current[2]):
                tried = [(current[1], order) for order in all_orders]
                for value, j in trials.ranked(tried, 1, current[0]):
                    current = (value, *tried[j])
                ended[-1] = trials.key(current[1], current[2])
            if current[0] >= before:
                break
        if best is None or current[0] < best[0]:
            best = current
    assert best is not None
    if best[0] == inf:
        return None
    return trials.cost(best[1], best[2])[1], (best[1], best[2])

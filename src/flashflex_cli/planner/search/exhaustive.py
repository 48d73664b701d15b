"""The `exhaustive` strategy: every layout of the planner's space, for clusters of at most 12 devices.

Devices are grouped into classes (same node, same fast-link island, same device description): inside
a class they are interchangeable (TP groups are cut inside a class, so never across a slow link), so a
pipeline is a vector of device counts per class, and a layout is a multiset of such vectors whose sum
fits in the cluster (devices left over are unused). For each pipeline every stage structure is enumerated:
every class's devices cut into TP groups of every supported-degree partition, class blocks in every
order and groups within a block in every distinct order, each with the exact layer split. Pipelines are then combined: per pipeline the structures are ranked by their time at the
pipeline's compute share of the batch, and the product over pipelines of the top structures is
enumerated -- all of them while the product stays under `PRODUCT_CAP` combinations, else the top few
per pipeline (the one approximation: with several pipelines of many structures each, a structure that is
poor alone but good in combination can be missed). Every combination gets the exact batch split and the
fast score; the finalists are ranked by `estimate`, as for every strategy. The enumeration honours the
time budget (the CLI says when it was cut).
"""

from __future__ import annotations

import itertools
import json
import math
import time

from ...errors import InputError
from ..scoring.candidate import Candidate, score
from ..scoring.cost_cache import CostCache, Devs
from ..scoring.pipeline_score import PipeEval, evaluate_pipeline
from ..space.tp_groups import partitions, tp_degrees

MAX_DEVICES = 12
PRODUCT_CAP = 4096


def _orders(parts: tuple[int, ...]) -> list[tuple[int, ...]]:
    return sorted(set(itertools.permutations(parts)))


def device_classes(cache: CostCache) -> list[list[int]]:
    """Device indices grouped by (node, fast-link island, device description), in cluster order."""
    g = cache.graph
    keys: dict[tuple[int, int, str], list[int]] = {}
    for i in range(g.size):
        node, local = int(g.node[i]), int(g.local[i])
        dev = g.cluster.nodes[node].devices[local]
        desc = json.dumps(dev.model_dump(mode="json"), sort_keys=True)
        keys.setdefault((node, int(g.island[i]), desc), []).append(i)
    return list(keys.values())


def _structures(cache: CostCache, blocks: list[list[int]]) -> list[tuple[Devs, ...]]:
    """Every stage structure of one pipeline whose devices are `blocks` (one list per class)."""
    degrees = tuple(tp_degrees(cache.model, max(len(b) for b in blocks)))
    per_block: list[list[list[Devs]]] = []
    for devs in blocks:
        options = []
        for parts in partitions(len(devs), degrees):
            for order in _orders(parts):
                groups, start = [], 0
                for size in order:
                    groups.append(tuple(devs[start:start + size]))
                    start += size
                options.append(groups)
        per_block.append(options)
    out = []
    for perm in itertools.permutations(range(len(blocks))):
        for choice in itertools.product(*(per_block[b] for b in perm)):
            stages = tuple(st for groups in choice for st in groups)
            if len(stages) <= cache.model.num_layers:
                out.append(stages)
    return out


def exhaustive_candidates(cache: CostCache, total_micro: int,
                          deadline: float = math.inf) -> tuple[list[Candidate], bool]:
    """Every layout of the space (module docstring), scored; InputError above 12 devices. Returns the
    candidates and whether the enumeration stopped at `deadline` (time.monotonic()): the candidates are then the
    layouts enumerated so far, and their best is not the optimum."""
    g = cache.graph
    if g.size > MAX_DEVICES:
        raise InputError(f"--strategy exhaustive handles at most {MAX_DEVICES} devices; the cluster has {g.size}")
    classes = device_classes(cache)
    avail = tuple(len(c) for c in classes)
    vectors = [v for v in itertools.product(*(range(a + 1) for a in avail)) if any(v)]
    total_flops = float(g.flops.sum())
    out: list[Candidate] = []

    def pipelines_for(layout: list[tuple[int, ...]]) -> list[list[PipeEval]] | None:
        taken = [0] * len(classes)
        options = []
        for vec in layout:
            blocks = []
            for c, n in enumerate(vec):
                if n:
                    blocks.append(classes[c][taken[c]:taken[c] + n])
                    taken[c] += n
            pipes = [evaluate_pipeline(cache, st) for st in _structures(cache, blocks)]
            pipes = [p for p in pipes if p.ok]
            if not pipes:
                return None
            share = sum(float(g.flops[i]) for b in blocks for i in b) / total_flops
            m = max(1, round(total_micro * share))
            pipes.sort(key=lambda p: ((p.fill_s + (max(m, p.num_stages) - 1) * p.pace_s) / max(m, p.num_stages),
                                      p.stages))
            options.append(pipes)
        return options

    def recurse(start: int, left: tuple[int, ...], layout: list[tuple[int, ...]]) -> None:
        if time.monotonic() >= deadline:
            nonlocal cut
            cut = True
            return
        if layout:
            options = pipelines_for(layout)
            if options is not None:
                keep = len(options[0])
                while keep > 1 and math.prod([min(keep, len(o)) for o in options]) > PRODUCT_CAP:
                    keep -= 1
                for combo in itertools.product(*(o[:keep] for o in options)):
                    cand = score(cache, list(combo), total_micro)
                    if cand is not None:
                        out.append(cand)
        for v in range(start, len(vectors)):
            vec = vectors[v]
            if all(n <= a for n, a in zip(vec, left, strict=True)):
                recurse(v, tuple(a - n for a, n in zip(left, vec, strict=True)), layout + [vec])

    cut = False
    recurse(0, avail, [])
    return out, cut

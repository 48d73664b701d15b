"""The cost model's answers about device groups, memoised for the planner's inner loops.

Every figure comes from `flashflex_cli.cost` (the single source of truth); this module only caches it
under keys that make equal questions share one answer: a stage is keyed by the node class and local
indices of its devices (devices of equal nodes cost the same), a pipeline hop by both ends' keys and the
link between their nodes. Memory caps assume the cost model's per-device memory is affine in the number
of layers (weights, optimizer state and activations all grow per layer) and check the answer exactly.

The modules that derive further answers from these (pipeline scores, the data-parallel term, the structure
search's pieces) own their memo tables; `CostCache.memo` keeps one of each per cache, so that they live as
long as the answers they were derived from (one planning question: one cluster, model, training
configuration and cost parameters).
"""

from __future__ import annotations

from typing import TypeVar

from ...cost.comm import p2p_time
from ...cost.compute import LayerTimes, layer_times
from ...cost.dp import gradient_bytes
from ...cost.memory import (
    MemoryBreakdown,
    communicator_bytes,
    device_capacity,
    device_reserve,
    is_cuda_group,
    minimum_communicators,
    stage_memory,
    stage_params_per_device,
)
from ...cost.params import CostParams
from ...model.flops import embedding_params, head_params, layer_params
from ...model.spec import ModelSpec
from ...plan.schema import TrainConfig
from ...semantics.optimizer_shards import ShardCounts
from ..space.graph import DeviceGraph

Devs = tuple[int, ...]
M = TypeVar("M")


class CostCache:
    """Memoised cost questions about device groups of one cluster, model and training configuration, at one
    micro-batch size (`micro_batch`, sequences)."""

    def __init__(self, graph: DeviceGraph, model: ModelSpec, train: TrainConfig, params: CostParams,
                 micro_batch: int = 1, optimizer_shard_ways: int = 1) -> None:
        self.graph, self.model, self.train, self.params = graph, model, train, params
        self.micro_batch = micro_batch
        # a sharded optimizer's search: every stage charged 1 / ways of its optimizer state (the exact shard of
        # a finished plan is `estimate`'s, which ranks the finalists)
        self.optimizer_shard_ways = optimizer_shard_ways
        # the runtime's memory paths differ on emulated CPU devices (a cluster is one or the other in practice)
        self.on_cuda = is_cuda_group(graph.cluster, graph.ids)
        self._stage: dict[int, LayerTimes] = {}
        self._stage_by_devs: dict[Devs, LayerTimes] = {}  # the same answers, keyed by the devices themselves
        self._p2p: dict[tuple, float] = {}
        self._p2p_by_devs: dict[tuple[Devs, Devs], float] = {}
        self._mem: dict[tuple, tuple[float, float]] = {}
        self._fit: dict[tuple, int] = {}
        self._keys: dict[Devs, int] = {}
        self._key_ids: dict[tuple, int] = {}
        self._group_cap: dict[Devs, float] = {}
        self._memos: dict[type, object] = {}
        self._cap: list[float] | None = None
        # a TP group's communicator, charged by the fabric that costs most (one memory curve for every device)
        self._tp_communicator_bytes = max(communicator_bytes(graph.cluster, d, params) for d in graph.ids)
        self._cap_rows: dict[tuple[int, float], list[int | None]] = {}
        # what the DP all-reduce moves for each part's gradients (bytes)
        self.layer_grad_bytes = float(gradient_bytes(layer_params(model), params))
        self.embed_grad_bytes = float(gradient_bytes(embedding_params(model), params))
        self.head_grad_bytes = float(gradient_bytes(head_params(model), params))

    def memo(self, kind: type[M]) -> M:
        """The memo table of class `kind` (built empty by `kind()` on first use) that lives as long as this cache:
        a module's own table of answers derived from this cache's."""
        found = self._memos.get(kind)
        if found is None:
            found = self._memos[kind] = kind()
        return found  # type: ignore[return-value]

    # ---- keys -------------------------------------------------------------------------------------
    def stage_key(self, devs: Devs) -> int:
        """Devices of equal nodes at equal local indices give equal answers: one number for each such class of
        device groups (assigned in order of first sight)."""
        key = self._keys.get(devs)
        if key is None:
            g = self.graph
            nodes = {int(g.node[i]) for i in devs}
            if len(nodes) == 1:
                shape: tuple = (g.node_class[nodes.pop()], tuple(int(g.local[i]) for i in devs))
            else:
                shape = ("multi", devs)
            key = self._keys[devs] = self._key_ids.setdefault(shape, len(self._key_ids))
        return key

    # ---- compute ----------------------------------------------------------------------------------
    def stage(self, devs: Devs) -> LayerTimes:
        """Per-micro-batch seconds of one layer / the embedding / the head on the TP group `devs`."""
        hit = self._stage_by_devs.get(devs)
        if hit is not None:
            return hit
        key = self.stage_key(devs)
        hit = self._stage.get(key)
        if hit is None:
            ids = [self.graph.ids[i] for i in devs]
            hit = layer_times(self.graph.cluster, ids, self.model, self.train, self.params, self.micro_batch)
            self._stage[key] = hit
        self._stage_by_devs[devs] = hit
        return hit

    def p2p(self, src: Devs, dst: Devs) -> float:
        """Seconds to pass one micro-batch's activation from stage `src` to stage `dst`."""
        direct = self._p2p_by_devs.get((src, dst))
        if direct is not None:
            return direct
        g = self.graph
        a, b = int(g.node[src[0]]), int(g.node[dst[0]])
        key = (self.stage_key(src), self.stage_key(dst), a == b, float(g.node_bw[a, b]))
        hit = self._p2p.get(key)
        if hit is None:
            ids_a = [g.ids[i] for i in src]
            ids_b = [g.ids[i] for i in dst]
            hit = p2p_time(g.cluster, ids_a, ids_b, self.model, self.train, self.params, self.micro_batch)
            self._p2p[key] = hit
        self._p2p_by_devs[(src, dst)] = hit
        return hit

    # ---- memory -----------------------------------------------------------------------------------
    def capacity(self, devs: Devs) -> float:
        """Usable bytes of the smallest device of the group."""
        hit = self._group_cap.get(devs)
        if hit is not None:
            return hit
        if self._cap is None:
            cluster = self.graph.cluster
            # stage_memory counts the GPU reserve; a device with another reserve (an emulated CPU) gets the
            # difference added to its capacity, so one memory curve serves every device. The NCCL communicators
            # every rank holds (the default group and the world's duplicate) come off each device's capacity.
            base = self.params.memory_reserve_bytes
            shared = minimum_communicators(1, self.graph.size)
            self._cap = [float(device_capacity(cluster, d, self.params)) - device_reserve(cluster, d, self.params)
                         - shared * communicator_bytes(cluster, d, self.params) + base for d in self.graph.ids]
        hit = min(self._cap[i] for i in devs)
        self._group_cap[devs] = hit
        return hit

    def _memory(self, tp: int, layers: int, first: bool, last: bool, in_flight: int) -> float:
        return float(self.stage_bytes_breakdown(tp, layers, first, last, in_flight).total)

    def max_layers(self, tp: int, first: bool, last: bool, in_flight: int, capacity: float) -> int:
        """Most layers (0..L) a stage of degree `tp` can hold within `capacity` bytes per device."""
        done = self._fit.get((tp, first, last, in_flight, capacity))
        if done is not None:
            return done
        key = (tp, first, last, in_flight)
        line = self._mem.get(key)
        total = self.model.num_layers
        if line is None:
            one = self._memory(tp, 1, first, last, in_flight)
            two = self._memory(tp, 2, first, last, in_flight) if total > 1 else one
            line = (one - (two - one), two - one)  # memory(n) ~= base + n * per_layer
            self._mem[key] = line
        base, per = line
        n = total if per <= 0 else int(min(total, max(0.0, (capacity - base) / per)))
        while n > 0 and self._memory(tp, n, first, last, in_flight) > capacity:
            n -= 1
        while n < total and self._memory(tp, n + 1, first, last, in_flight) <= capacity:
            n += 1
        self._fit[(tp, first, last, in_flight, capacity)] = n
        return n

    def cap_row(self, tp: int, capacity: float) -> list[int | None]:
        """A middle stage's `max_layers(tp, False, False, f, capacity)` at index f (in-flight micro-batches,
        1..L), filled on demand by `middle_cap`: one shared list per (degree, capacity bytes)."""
        key = (tp, capacity)
        row = self._cap_rows.get(key)
        if row is None:
            row = self._cap_rows[key] = [None] * (self.model.num_layers + 1)
        return row

    def middle_cap(self, row: list[int | None], tp: int, capacity: float, in_flight: int) -> int:
        """`row[in_flight]` of `cap_row(tp, capacity)`, computed (`max_layers`) and stored when missing."""
        found = row[in_flight]
        if found is None:
            found = row[in_flight] = self.max_layers(tp, False, False, in_flight, capacity)
        return found

    def stage_bytes_breakdown(self, tp: int, layers: int, first: bool, last: bool, in_flight: int) -> MemoryBreakdown:
        """The cost model's MemoryBreakdown of a stage (bytes per device), charged the NCCL communicators every
        such stage holds (`minimum_communicators`; `estimate` charges a finished plan's exact count)."""
        extra = minimum_communicators(tp, self.graph.size) - minimum_communicators(1, self.graph.size)  # TP's
        shard = ShardCounts()
        if self.optimizer_shard_ways > 1:
            held = int(sum(stage_params_per_device(self.model, tp, layers, first, last)))
            shard = ShardCounts(held, held // self.optimizer_shard_ways)
        return stage_memory(self.model, self.train, tp, layers, first, last, in_flight, self.params,
                            self.micro_batch, on_cuda=self.on_cuda, nccl_bytes=extra * self._tp_communicator_bytes,
                            optimizer_shard=shard)

    def stage_bytes(self, tp: int, layers: int, first: bool, last: bool, in_flight: int) -> float:
        """Bytes per device of a stage (the cost model's figure)."""
        return self._memory(tp, layers, first, last, in_flight)

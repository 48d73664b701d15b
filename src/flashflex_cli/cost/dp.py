"""Data-parallel gradient reduction across pipelines whose stages hold the same layers: what the runtime's
runtime/parallel/grad_sync.py does, as pure functions.

Buckets (runtime/parallel/grad_buckets.py). Every layer is held by one stage per pipeline (its "holders"); the embedding
by the first stages (with tied embeddings also by the last stages of pipelines of two or more stages), the final
norm and the head by the last stages. With `dp_overlap` (the runtime's default) there is one bucket per layer and
holder set, reduced in one global order: head, final norm, layers from the last to the first, embedding last.
Without it, one bucket per holder set (all its layers together), ordered by holder tuple.

One bucket of `n` parameters among P holder stages (volume per TP slice v = n / min holder TP x
grad_reduce_bytes; the TP slices' rings run in parallel on their own devices, but where they cross nodes they
share the node's NIC, so the volume through a NIC is the whole n x grad_reduce_bytes):
- flat (one ring over all holders' first devices, in pipeline order): ring all-reduce at the ring's slowest
  hop (comm.ring_allreduce_seconds);
- hierarchical (`dp_hierarchical`, runtime/parallel/hier_reduce.py), where the holders span several nodes and some node
  has two or more of them: reduce inside every node to its leader and broadcast back afterwards (together one
  ring all-reduce of v among the node's k holders over the intra-node link; nodes in parallel, the slowest
  sets the time), then a ring all-reduce of n x grad_reduce_bytes among the m node leaders over their slowest
  inter-node path. Holders all on one node, or one per node: the flat ring.

Timeline (per-layer overlap): a stage's last backward is split over its parts in proportion to their backward
cost (head and final norm first on the last stage, then its layers from the top, the embedding last on the first
stage), and a layer's bucket is ready on a holder when that holder has finished the layer (a tied embedding's
bucket when the holder's backward has ended: the runtime issues it after the schedule). Buckets are taken in
the global order; each starts when every holder has it ready and has finished its previous buckets; the
inter-node part also waits for the NICs it crosses (one shared channel per node). A stage's reduction ends with
its last bucket; its exposed DP time is how far that end lies after its last backward ends.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..hardware.cluster import Cluster
from ..model import flops as model_flops
from ..plan.schema import Plan
from ..semantics.buckets import KEY_EMBED, KEY_HEAD, KEY_NORM, KEY_UNORDERED, overlap_order
from .comm import ring_allreduce_seconds, ring_link
from .params import CostParams
from .view import view

StageKey = tuple[int, int]


@dataclass(frozen=True)
class DPBucket:
    """One collective: `holders` (sorted stage keys) sum the gradients of `params` parameters. `key`: its
    backward order (layer index, KEY_HEAD, KEY_NORM, KEY_EMBED; 0 for holder-set buckets). `inside_s`: the
    intra-node reduce and broadcast together (s, half before and half after the inter-node part); `across_s`:
    the part on the nodes' NICs (s); `nodes`: the nodes whose NIC `across_s` uses."""

    key: int
    holders: tuple[StageKey, ...]
    params: float
    inside_s: float
    across_s: float
    nodes: frozenset[str]

    @property
    def seconds(self) -> float:
        """Duration of the bucket's reduction without waits (s)."""
        return self.inside_s + self.across_s


class BucketTime(NamedTuple):
    """Seconds of one bucket's reduction without waits: `inside_s`, the intra-node reduce and broadcast together
    (half before and half after the inter-node part); `across_s`, the part on the nodes' NICs; `nodes`, the keys of
    the nodes whose NIC `across_s` uses (empty when it uses none)."""

    inside_s: float
    across_s: float
    nodes: frozenset


def gradient_bytes(param_count: float, params: CostParams) -> float:
    """Bytes the DP all-reduce moves for `param_count` parameters' gradients."""
    return param_count * params.grad_reduce_bytes


def ring_bucket_time(cluster: Cluster, firsts: Sequence[str], nodes: Sequence[Hashable], min_tp: int, nbytes: float,
                     params: CostParams) -> BucketTime:
    """`BucketTime` of one all-reduce of `nbytes` (the whole gradient) among holder stages whose first devices are
    `firsts` (pipeline order), `nodes[i]` the key of the node of `firsts[i]` (any hashable: a name, an index),
    `min_tp` the smallest holder's TP degree (see the module docstring for the flat and hierarchical schedules)."""
    by_node: dict[Hashable, list[str]] = {}
    for device, node in zip(firsts, nodes, strict=True):
        by_node.setdefault(node, []).append(device)
    eff = params.dp_comm_efficiency

    def ring(members: Sequence[str], size: float) -> float:
        bandwidth, latency = ring_link(cluster, members)
        return ring_allreduce_seconds(len(members), size, bandwidth * eff, latency)

    if len(by_node) == 1:  # one node: the TP slices' rings run in parallel on their own devices
        return BucketTime(ring(firsts, nbytes / min_tp), 0.0, frozenset())
    if params.dp_hierarchical and any(len(ds) > 1 for ds in by_node.values()):
        inside = max(ring(ds, nbytes / min_tp) for ds in by_node.values() if len(ds) > 1)
        return BucketTime(inside, ring([ds[0] for ds in by_node.values()], nbytes), frozenset(by_node))
    return BucketTime(0.0, ring(firsts, nbytes), frozenset(by_node))


def bucket_cost(plan: Plan, cluster: Cluster, holders: Iterable[StageKey], param_count: float,
                params: CostParams) -> BucketTime:
    """`BucketTime` of one all-reduce of `param_count` parameters' gradients among the holder stages (node keys:
    node names)."""
    stages = [plan.pipelines[p].stages[s] for p, s in holders]
    if len(stages) < 2 or param_count <= 0:
        return BucketTime(0.0, 0.0, frozenset())
    cv = view(cluster)
    firsts = [st.devices[0] for st in stages]
    return ring_bucket_time(cluster, firsts, [cv.info(d).node for d in firsts], min(st.tp for st in stages),
                            gradient_bytes(param_count, params), params)


def _holder_sets(plan: Plan) -> list[tuple[int, list[StageKey], float]]:
    """(key, holders, parameter count) of every layer, the final norm, the head and the embedding."""
    model = plan.inputs.model
    out: list[tuple[int, list[StageKey], float]] = []
    for layer in range(model.num_layers):
        holders = []
        for p, pipe in enumerate(plan.pipelines):
            s = next(s for s, st in enumerate(pipe.stages) if st.layers[0] <= layer < st.layers[1])
            holders.append((p, s))
        out.append((layer, holders, model_flops.layer_params(model)))
    firsts = [(p, 0) for p in range(len(plan.pipelines))]
    lasts = [(p, len(pipe.stages) - 1) for p, pipe in enumerate(plan.pipelines)]
    out.append((KEY_NORM, lasts, float(model.hidden_size)))
    if model.tie_embeddings:  # the last stages' copies of the embedding reduce with the first stages'
        out.append((KEY_EMBED, firsts + [k for k in lasts if k[1] > 0], model_flops.embedding_params(model)))
    else:
        out.append((KEY_HEAD, lasts, model_flops.head_params(model) - model.hidden_size))  # head_params counts the norm
        out.append((KEY_EMBED, firsts, model_flops.embedding_params(model)))
    return out


def dp_buckets(plan: Plan, cluster: Cluster, params: CostParams) -> list[DPBucket]:
    """The runtime's DP buckets of `plan` in their global order (none when no two stages share a parameter)."""
    sets = [(key, tuple(sorted(holders)), count) for key, holders, count in _holder_sets(plan) if len(holders) > 1]
    merged: dict[tuple[int, tuple[StageKey, ...]], float] = {}
    for key, holders, count in sets:
        k = (key if params.dp_overlap else KEY_UNORDERED, holders)
        merged[k] = merged.get(k, 0.0) + count
    order = sorted(merged, key=lambda k: overlap_order(*k))
    out = []
    costs: dict[tuple[tuple[StageKey, ...], float], BucketTime] = {}
    for key, holders in order:
        count = merged[(key, holders)]
        if (holders, count) not in costs:  # the layers of one segment share holders and size
            costs[(holders, count)] = bucket_cost(plan, cluster, holders, count, params)
        out.append(DPBucket(key, holders, count, *costs[(holders, count)]))
    return out


def dp_partners(buckets: Iterable[DPBucket]) -> dict[StageKey, tuple[StageKey, ...]]:
    """For every stage that takes part in a reduction: the other stages it reduces with (sorted)."""
    partners: dict[StageKey, set[StageKey]] = {}
    for holders in {b.holders for b in buckets}:
        for h in holders:
            partners.setdefault(h, set()).update(holders)
    return {k: tuple(sorted(v - {k})) for k, v in partners.items()}


@dataclass(frozen=True)
class StageBackward:
    """One stage's last backward pass, in seconds since the iteration start: it runs from start_s to end_s;
    the head and final norm take its first head_s (last stage), then each layer layer_s, top layer first, the
    embedding the rest (first stage). `layers` [lo, hi); `first`: the stage holds the embedding lookup."""

    start_s: float
    end_s: float
    head_s: float
    layer_s: float
    layers: tuple[int, int]
    first: bool

    def ready_s(self, key: int, overlap: bool) -> float:
        """When this stage's gradients of bucket `key` are final (without overlap: the backward's end)."""
        if not overlap:
            return self.end_s
        if key >= KEY_NORM:
            return self.start_s + self.head_s
        if key == KEY_EMBED:  # the lookup end is the first stage's last gradient; a tied last stage's copy is
            return self.end_s  # reduced after its schedule (runtime/grad_buckets.Bucket.after_schedule)
        return min(self.end_s, layer_ready_s(self.start_s, self.head_s, self.layer_s, self.layers[1] - key))


def layer_ready_s(start_s: float, head_s: float, layer_s: float, above: int) -> float:
    """When a stage's last backward, begun at `start_s`, has finished the layer `above` layers from the top of the
    stage's range (the top layer: 1; 0: the head): the head's `head_s` first, then `layer_s` per layer, top layer
    first (s)."""
    return start_s + head_s + above * layer_s


def layers_ready_s(start_s: Sequence[float], head_s: Sequence[float], layer_s: Sequence[float],
                   counts: Sequence[int]) -> list[float]:
    """`layer_ready_s` of every layer of consecutive stages (stage j: its last backward begun at start_s[j], the
    head's head_s[j] first, layer_s[j] per layer, counts[j] layers), each stage's bottom layer first (s): the same
    sums, a stage at a time."""
    out: list[float] = []
    for start, head, layer, count in zip(start_s, head_s, layer_s, counts, strict=True):
        begin = start + head
        out += [begin + above * layer for above in range(count, 0, -1)]
    return out


class NicQueue:
    """When each node's NIC is next free (s), for buckets run one after another in their global order: a bucket's
    cross-node part waits for every NIC it crosses, then holds them. The NICs of the last cross-node bucket are
    all free at the same moment, so they are written back only when they leave the next bucket's set (buckets of
    a segment share their `nodes`; consecutive buckets mostly share their nodes)."""

    __slots__ = ("free", "_nodes", "_done")

    def __init__(self) -> None:
        self.free: dict[Hashable, float] = {}  # by node, except the last bucket's
        self._nodes: frozenset | None = None  # the last cross-node bucket's nodes
        self._done = 0.0  # when it freed them

    def run(self, begin: float, inside_s: float, across_s: float, nodes: frozenset) -> float:
        """End (s) of one bucket that may begin at `begin`: the intra-node half, the cross-node part once its NICs
        are free, the other intra-node half."""
        across = begin + inside_s / 2
        if nodes:
            held = self._nodes
            if nodes is held:
                if self._done > across:
                    across = self._done
            else:
                free = self.free
                if held is None:
                    fresh = nodes
                else:
                    if self._done > across and not nodes.isdisjoint(held):
                        across = self._done
                    for n in held - nodes:
                        free[n] = self._done
                    fresh = nodes - held
                for n in fresh:
                    wait = free.get(n, 0.0)
                    if wait > across:
                        across = wait
                self._nodes = nodes
            self._done = across + across_s
            return self._done + inside_s / 2
        return across + across_s + inside_s / 2


@dataclass(frozen=True)
class DPResult:
    """stage_seconds[(p, s)]: seconds of the reductions that stage takes part in, waits excluded (s);
    partners[(p, s)]: the stages it reduces with; end_s: when its last reduction ends (its last backward's end
    when it has none); exposed_s: end_s less its last backward's end (s)."""

    stage_seconds: dict[StageKey, float]
    partners: dict[StageKey, tuple[StageKey, ...]]
    end_s: dict[StageKey, float]
    exposed_s: dict[StageKey, float]


def dp_timeline(buckets: list[DPBucket], backward: dict[StageKey, StageBackward], overlap: bool,
                partners: dict[StageKey, tuple[StageKey, ...]] | None = None) -> DPResult:
    """Run the buckets in their global order against each stage's last backward (see the module docstring).
    `partners`: `dp_partners(buckets)` when already computed."""
    free: dict[StageKey, float] = {}
    nics = NicQueue()
    seconds: dict[StageKey, float] = {}
    for b in buckets:
        start = max(max(backward[h].ready_s(b.key, overlap) for h in b.holders),
                    max(free.get(h, 0.0) for h in b.holders))
        end = nics.run(start, b.inside_s, b.across_s, b.nodes)
        for h in b.holders:
            free[h] = end
            seconds[h] = seconds.get(h, 0.0) + b.seconds
    end_s = {k: max(bw.end_s, free.get(k, 0.0)) for k, bw in backward.items()}
    exposed = {k: end_s[k] - bw.end_s for k, bw in backward.items()}
    return DPResult(seconds, dp_partners(buckets) if partners is None else partners, end_s, exposed)


def dp_reduction(plan: Plan, cluster: Cluster, params: CostParams,
                 backward: dict[StageKey, StageBackward] | None = None) -> DPResult:
    """DP reduction of `plan`: per-stage seconds and partners (no entries when no stages share a parameter);
    with `backward` (every stage's last backward) also when each stage's reduction ends."""
    buckets = dp_buckets(plan, cluster, params)
    if backward is None:
        backward = {(p, s): StageBackward(0.0, 0.0, 0.0, 0.0, tuple(st.layers), s == 0)  # type: ignore[arg-type]
                    for p, pipe in enumerate(plan.pipelines) for s, st in enumerate(pipe.stages)}
    return dp_timeline(buckets, backward, params.dp_overlap)

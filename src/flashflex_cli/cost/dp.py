"""Data-parallel gradient reduction across pipelines whose stages hold the same layers: what the runtime's
runtime/grad_sync.py does, as pure functions.

Buckets (runtime/grad_buckets.py). Every layer is held by one stage per pipeline (its "holders"); the embedding
by the first stages (with tied embeddings also by the last stages of pipelines of two or more stages), the final
norm and the head by the last stages. With `dp_overlap` (the runtime's default) there is one bucket per layer and
holder set, reduced in one global order: head, final norm, layers from the last to the first, embedding last.
Without it, one bucket per holder set (all its layers together), ordered by holder tuple.

One bucket of `n` parameters among P holder stages (volume per TP slice v = n / min holder TP x
grad_reduce_bytes; the TP slices' rings run in parallel on their own devices, but where they cross nodes they
share the node's NIC, so the volume through a NIC is the whole n x grad_reduce_bytes):
- flat (one ring over all holders' first devices, in pipeline order): ring all-reduce at the ring's slowest
  hop (comm.ring_allreduce_seconds);
- hierarchical (`dp_hierarchical`, runtime/hier_reduce.py), where the holders span several nodes and some node
  has two or more of them: reduce inside every node to its leader and broadcast back afterwards (together one
  ring all-reduce of v among the node's k holders over the intra-node link; nodes in parallel, the slowest
  sets the time), then a ring all-reduce of n x grad_reduce_bytes among the m node leaders over their slowest
  inter-node path. Holders all on one node, or one per node: the flat ring.

Timeline (per-layer overlap): a stage's last backward is split over its parts in proportion to their backward
cost (head and final norm first on the last stage, then its layers from the top, the embedding last on the first
stage), and a layer's bucket is ready on a holder when that holder has finished the layer. Buckets are taken in
the global order; each starts when every holder has it ready and has finished its previous buckets; the
inter-node part also waits for the NICs it crosses (one shared channel per node). A stage's reduction ends with
its last bucket; its exposed DP time is how far that end lies after its last backward ends.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..hardware.cluster import Cluster
from ..model import flops as F
from ..plan.schema import Plan
from .comm import ring_allreduce_seconds, ring_link
from .params import CostParams
from .view import view

StageKey = tuple[int, int]

# backward-order keys of the non-layer buckets (larger = earlier; layers use their index)
KEY_NORM = 1 << 30
KEY_HEAD = KEY_NORM + 1
KEY_EMBED = -1


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


def bucket_cost(plan: Plan, cluster: Cluster, holders: Iterable[StageKey], param_count: float,
                params: CostParams) -> tuple[float, float, frozenset[str]]:
    """(inside_s, across_s, nodes) of one all-reduce of `param_count` parameters' gradients among the holder
    stages (see the module docstring for the flat and hierarchical schedules)."""
    cv = view(cluster)
    stages = [plan.pipelines[p].stages[s] for p, s in holders]
    if len(stages) < 2 or param_count <= 0:
        return 0.0, 0.0, frozenset()
    min_tp = min(st.tp for st in stages)
    firsts = [st.devices[0] for st in stages]
    grad_bytes = param_count * params.grad_reduce_bytes  # the whole gradient
    eff = params.dp_comm_efficiency
    by_node: dict[str, list[str]] = {}
    for d in firsts:
        by_node.setdefault(cv.info(d).node, []).append(d)
    nodes = frozenset(by_node)
    if len(by_node) == 1:  # one node: the TP slices' rings run in parallel on their own devices
        bandwidth, latency = ring_link(cluster, firsts)
        return ring_allreduce_seconds(len(firsts), grad_bytes / min_tp, bandwidth * eff, latency), 0.0, frozenset()
    if params.dp_hierarchical and any(len(ds) > 1 for ds in by_node.values()):
        inside = 0.0
        for ds in by_node.values():
            if len(ds) > 1:
                bandwidth, latency = ring_link(cluster, ds)
                inside = max(inside, ring_allreduce_seconds(len(ds), grad_bytes / min_tp, bandwidth * eff, latency))
        leaders = [ds[0] for ds in by_node.values()]
        bandwidth, latency = ring_link(cluster, leaders)
        return inside, ring_allreduce_seconds(len(leaders), grad_bytes, bandwidth * eff, latency), nodes
    bandwidth, latency = ring_link(cluster, firsts)
    return 0.0, ring_allreduce_seconds(len(firsts), grad_bytes, bandwidth * eff, latency), nodes


def _holder_sets(plan: Plan) -> list[tuple[int, list[StageKey], float]]:
    """(key, holders, parameter count) of every layer, the final norm, the head and the embedding."""
    model = plan.inputs.model
    out: list[tuple[int, list[StageKey], float]] = []
    for layer in range(model.num_layers):
        holders = []
        for p, pipe in enumerate(plan.pipelines):
            s = next(s for s, st in enumerate(pipe.stages) if st.layers[0] <= layer < st.layers[1])
            holders.append((p, s))
        out.append((layer, holders, F.layer_params(model)))
    firsts = [(p, 0) for p in range(len(plan.pipelines))]
    lasts = [(p, len(pipe.stages) - 1) for p, pipe in enumerate(plan.pipelines)]
    out.append((KEY_NORM, lasts, float(model.hidden_size)))
    if model.tie_embeddings:  # the last stages' copies of the embedding reduce with the first stages'
        out.append((KEY_EMBED, firsts + [k for k in lasts if k[1] > 0], F.embedding_params(model)))
    else:
        out.append((KEY_HEAD, lasts, F.head_params(model) - model.hidden_size))  # head_params counts the norm
        out.append((KEY_EMBED, firsts, F.embedding_params(model)))
    return out


def dp_buckets(plan: Plan, cluster: Cluster, params: CostParams) -> list[DPBucket]:
    """The runtime's DP buckets of `plan` in their global order (none when no two stages share a parameter)."""
    sets = [(key, tuple(sorted(holders)), count) for key, holders, count in _holder_sets(plan) if len(holders) > 1]
    merged: dict[tuple[int, tuple[StageKey, ...]], float] = {}
    for key, holders, count in sets:
        k = (key if params.dp_overlap else 0, holders)
        merged[k] = merged.get(k, 0.0) + count
    order = sorted(merged, key=lambda k: (-k[0], k[1]))
    out = []
    costs: dict[tuple[tuple[StageKey, ...], float], tuple[float, float, frozenset[str]]] = {}
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
        if key == KEY_EMBED:  # the lookup end is the first stage's last gradient; a tied last stage's copy is early
            return self.end_s if self.first else self.start_s + self.head_s
        return min(self.end_s, self.start_s + self.head_s + (self.layers[1] - key) * self.layer_s)


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
    nic_free: dict[str, float] = {}
    seconds: dict[StageKey, float] = {}
    for b in buckets:
        start = max(max(backward[h].ready_s(b.key, overlap) for h in b.holders),
                    max(free.get(h, 0.0) for h in b.holders))
        across_start = max([start + b.inside_s / 2] + [nic_free.get(n, 0.0) for n in b.nodes])
        for n in b.nodes:
            nic_free[n] = across_start + b.across_s
        end = across_start + b.across_s + b.inside_s / 2
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

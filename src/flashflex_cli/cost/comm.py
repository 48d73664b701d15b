"""Communication times: ring all-reduce over a group's real links, stage-to-stage activation transfer.

Alpha-beta model (Hockney): a message of n bytes over a link of bandwidth B (bytes/s) and latency a (s)
takes a + n / B. A ring all-reduce of n bytes among p devices moves 2 (p - 1) / p * n bytes over every
ring hop in 2 (p - 1) steps (Patarasuk & Yuan 2009), so the slowest hop sets the pace; a ring all-gather
moves (p - 1) / p * n bytes per hop in p - 1 steps.

Stage-to-stage transfers are charged as the runtime makes them (runtime/parallel/pipeline.py): by default the lean
scatter-gather of semantics/boundary.py in the compute dtype, else full fp32 copies to every receiving rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..hardware.cluster import Cluster
from ..model.flops import dtype_bytes
from ..model.spec import ModelSpec
from ..plan.schema import TrainConfig
from ..semantics.boundary import chunk_route
from ..semantics.runtime_paths import compute_dtype
from .params import CostParams
from .view import view


def ring_allreduce_seconds(participants: int, nbytes: float, bandwidth: float, latency_s: float) -> float:
    """Seconds for a ring all-reduce of `nbytes` among `participants` over hops of `bandwidth` bytes/s."""
    if participants <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (participants - 1)
    return steps * latency_s + steps / participants * nbytes / bandwidth


def ring_link(cluster: Cluster, devices: Sequence[str]) -> tuple[float, float]:
    """(slowest bandwidth in bytes/s, largest latency in s) over the ring devices[0] -> ... -> devices[0]."""
    cv = view(cluster)
    bandwidth, latency = float("inf"), 0.0
    n = len(devices)
    for i in range(n):
        link = cv.link(devices[i], devices[(i + 1) % n])
        bandwidth = min(bandwidth, link.bandwidth)
        latency = max(latency, link.latency_s)
    return bandwidth, latency


def allreduce_time(cluster: Cluster, devices: Sequence[str], nbytes: float, params: CostParams,
                   efficiency: float | None = None) -> float:
    """Seconds for a ring all-reduce of `nbytes` bytes among `devices`, over the ring's slowest link.

    `efficiency`: achieved fraction of link bandwidth (default `params.tp_comm_efficiency`).
    """
    if len(devices) <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = ring_link(cluster, devices)
    eff = params.tp_comm_efficiency if efficiency is None else efficiency
    return ring_allreduce_seconds(len(devices), nbytes, bandwidth * eff, latency)


def transfer_time(cluster: Cluster, src: Sequence[str], dst: Sequence[str], nbytes: float,
                  efficiency: float = 1.0) -> float:
    """Seconds to deliver a tensor of `nbytes`, replicated on every `src` device, to every `dst` device.

    Destination j receives the whole tensor from source j mod len(src) (any TP degrees on either side).
    Transfers that share a channel run one after another: a source device's own link inside a node,
    or the NIC pair between two nodes; distinct channels run in parallel.
    """
    if nbytes <= 0 or not src or not dst:
        return 0.0
    cv = view(cluster)
    key = (tuple(src), tuple(dst), nbytes, efficiency)
    found = cv.transfers.get(key)
    if found is not None:
        return found
    channels: dict[tuple[str, str], float] = {}
    for j, target in enumerate(dst):
        source = src[j % len(src)]
        link = cv.link(source, target)
        a, b = cv.info(source).node, cv.info(target).node
        channel = (source, "") if a == b else (a, b)
        channels[channel] = channels.get(channel, 0.0) + link.latency_s + nbytes / (link.bandwidth * efficiency)
    found = max(channels.values())
    cv.transfers[key] = found
    return found


def ring_allgather_seconds(participants: int, nbytes: float, bandwidth: float, latency_s: float) -> float:
    """Seconds for a ring all-gather that leaves `nbytes` on each of `participants` devices (each starts with
    1/participants of it) over hops of `bandwidth` bytes/s."""
    if participants <= 1 or nbytes <= 0:
        return 0.0
    steps = participants - 1
    return steps * latency_s + steps / participants * nbytes / bandwidth


def transfer_element_bytes(train: TrainConfig) -> int:
    """Bytes per element of a lean stage-boundary transfer: the compute dtype's (2 for bf16 and fp16, which the
    runtime computes in under autocast on every device, 4 for fp32 and tf32; semantics/runtime_paths.py)."""
    return dtype_bytes(compute_dtype(train.dtype))


def lean_transfer_time(cluster: Cluster, src: Sequence[str], dst: Sequence[str], nbytes: float,
                       efficiency: float = 1.0, gather_efficiency: float = 1.0) -> float:
    """Seconds to deliver a tensor of `nbytes`, replicated on every `src` device, to every `dst` device by
    scatter-gather (semantics/boundary.py `chunk_route`: n = lcm(t, t') chunks, chunk k from src[k % t] to
    dst[k % t']), then the `dst` group all-gathers the chunks (a ring over its slowest hop).

    Sends that share a channel (a source device's own link inside a node, or the NIC pair between two nodes)
    run one after another, distinct channels in parallel, as in `transfer_time`; the all-gather follows.
    """
    if nbytes <= 0 or not src or not dst:
        return 0.0
    cv = view(cluster)
    key = ("lean", tuple(src), tuple(dst), nbytes, efficiency, gather_efficiency)
    found = cv.transfers.get(key)
    if found is not None:
        return found
    route = chunk_route(len(src), len(dst))
    chunk = nbytes / len(route)
    channels: dict[tuple[str, str], float] = {}
    for sender, receiver in route:
        source, target = src[sender], dst[receiver]
        link = cv.link(source, target)
        a, b = cv.info(source).node, cv.info(target).node
        channel = (source, "") if a == b else (a, b)
        channels[channel] = channels.get(channel, 0.0) + link.latency_s + chunk / (link.bandwidth * efficiency)
    found = max(channels.values())
    if len(dst) > 1:
        bandwidth, latency = ring_link(cluster, dst)
        found += ring_allgather_seconds(len(dst), nbytes, bandwidth * gather_efficiency, latency)
    cv.transfers[key] = found
    return found


def p2p_time(cluster: Cluster, src: Sequence[str], dst: Sequence[str], model: ModelSpec, train: TrainConfig,
             params: CostParams, micro_batch_size: int, lean: bool = True) -> float:
    """Seconds to pass one micro-batch's activation [mbs, seq, hidden] from stage `src` to stage `dst`.

    `lean` (the runtime's default, RuntimeOptions.lean_p2p): scatter-gather in the compute dtype
    (`transfer_element_bytes`, `lean_transfer_time`; the receivers' all-gather at `params.tp_comm_efficiency`).
    Otherwise every destination receives the whole tensor at `params.activation_transfer_bytes` per element
    (4: fp32, what the runtime sends with lean transfers off).
    The same time applies to the gradient sent back in the backward pass (call with the stages swapped).
    `micro_batch_size`: the pipeline's micro-batch, mbs sequences.
    """
    numel = micro_batch_size * train.seq_len * model.hidden_size
    if lean:
        nbytes = numel * transfer_element_bytes(train)
        return lean_transfer_time(cluster, src, dst, nbytes, params.p2p_efficiency, params.tp_comm_efficiency)
    return transfer_time(cluster, src, dst, numel * params.activation_transfer_bytes, params.p2p_efficiency)

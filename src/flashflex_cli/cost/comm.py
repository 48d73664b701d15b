"""Communication times: ring all-reduce over a group's real links, stage-to-stage activation transfer.

Alpha-beta model (Hockney): a message of n bytes over a link of bandwidth B (bytes/s) and latency a (s)
takes a + n / B. A ring all-reduce of n bytes among p devices moves 2 (p - 1) / p * n bytes over every
ring hop in 2 (p - 1) steps (Patarasuk & Yuan 2009), so the slowest hop sets the pace.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..hardware.cluster import Cluster
from ..model.spec import ModelSpec
from ..plan.schema import TrainConfig
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


def p2p_time(cluster: Cluster, src: Sequence[str], dst: Sequence[str], model: ModelSpec, train: TrainConfig,
             params: CostParams, micro_batch_size: int | None = None) -> float:
    """Seconds to pass one micro-batch's activation [mbs, seq, hidden] from stage `src` to stage `dst`,
    `params.activation_transfer_bytes` per element.

    The same time applies to the gradient sent back in the backward pass.
    `micro_batch_size`: the pipeline's own (default train.micro_batch_size).
    """
    mbs = micro_batch_size or train.micro_batch_size
    nbytes = mbs * train.seq_len * model.hidden_size * params.activation_transfer_bytes
    return transfer_time(cluster, src, dst, nbytes, params.p2p_efficiency)

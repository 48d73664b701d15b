"""Measure a fleet under torchrun: every node's devices and every node pair's bandwidth.

Run one process per node (or several: only LOCAL_RANK 0 of each node probes), e.g.
`torchrun --nnodes=3 --nproc-per-node=1 ... -m flashflex_cli.cli profile --distributed --out F`.
Each node leader probes its local devices; then for every leader pair, in a fixed order and one pair
at a time, the lower rank sends a large tensor and waits for a one-element acknowledgement
(best of a few runs), with torch.distributed point-to-point (gloo on CPU, NCCL on GPU). Rank 0 gathers
everything and returns one merged Cluster; other ranks return None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from itertools import combinations
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InputError, RuntimeFailure
from .cluster import Cluster, Node, NodePair
from .device_sync import synchronize
from .merge import cluster_of_nodes
from .probe_local import check_node_options, profile_node, sig

MIB = 1024**2


@dataclass(frozen=True)
class TransferSizes:
    """Point-to-point probe: message size (bytes) and timed repeats after one warm-up."""

    nbytes: int
    repeats: int


QUICK = TransferSizes(nbytes=32 * MIB, repeats=3)
FULL = TransferSizes(nbytes=64 * MIB, repeats=5)


@dataclass(frozen=True)
class PairResult:
    """Measured link from leader rank `src` to leader rank `dst`: bytes/s and one-way latency (s)."""

    src: int
    dst: int
    bandwidth: float
    latency_s: float


def _ping_pong(peer: int, payload: torch.Tensor, ack: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """Seconds to send `payload` to `peer` and receive its one-element acknowledgement."""
    start = time.perf_counter()
    dist.send(payload, dst=peer, group=group)
    dist.recv(ack, src=peer, group=group)
    synchronize(ack.device)  # NCCL calls only enqueue work on a stream
    return time.perf_counter() - start


def _echo(peer: int, payload: torch.Tensor, ack: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    dist.recv(payload, src=peer, group=group)
    dist.send(ack, dst=peer, group=group)


def measure_pair(rank: int, src: int, dst: int, sizes: TransferSizes, device: torch.device,
                 group: dist.ProcessGroup | None = None) -> PairResult | None:
    """Both ends call this; `src` times transfers to `dst` and returns the result, `dst` returns None.

    Bandwidth = nbytes / best round time (the acknowledgement is 4 bytes); latency = half the best
    round trip of a 4-byte message. Ranks are global ranks of the default group.
    """
    payload = torch.ones(sizes.nbytes // 4, dtype=torch.float32, device=device)
    small = torch.ones(1, dtype=torch.float32, device=device)
    ack = torch.zeros(1, dtype=torch.float32, device=device)
    if rank == dst:
        for _ in range(sizes.repeats + 1):
            _echo(src, small, ack, group)
        for _ in range(sizes.repeats + 1):
            _echo(src, payload, ack, group)
        return None
    rtt = min(_ping_pong(dst, small, ack, group) for _ in range(sizes.repeats + 1))
    _ping_pong(dst, payload, ack, group)  # warm-up: connection set-up, TCP window growth
    best = min(_ping_pong(dst, payload, ack, group) for _ in range(sizes.repeats))
    return PairResult(src, dst, sizes.nbytes / max(best - rtt, 1e-9), max(rtt / 2, 1e-9))


def unique_names(names: list[str]) -> list[str]:
    """Node names made unique: every name used more than once gets "-K" (K = position in the list)."""
    return [f"{n}-{k}" if names.count(n) > 1 else n for k, n in enumerate(names)]


def _env_int(key: str) -> int:
    value = os.environ.get(key)
    if value is None or not value.isdigit():
        raise InputError(
            f"--distributed needs torchrun's environment ({key} is not set); run e.g. "
            "`torchrun --nnodes=N --nproc-per-node=1 ... -m flashflex_cli.cli profile --distributed --out F`"
        )
    return int(value)


def profile_distributed(quick: bool = False, cpu_devices: int = 1, node_name: str | None = None,
                        nic: str = "eth", name: str = "cluster", description: str | None = None,
                        timeout_s: float = 300.0, slowdown: float = 1.0) -> Cluster | None:
    """Probe every node and node pair of a torchrun job; rank 0 returns the merged Cluster. `slowdown`: this
    node's CPU devices emulate devices that many times slower (each node passes its own)."""
    check_node_options(nic, node_name, cpu_devices, slowdown)  # on every rank, before any collective can hang
    rank, local_rank, world = _env_int("RANK"), _env_int("LOCAL_RANK"), _env_int("WORLD_SIZE")
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    sizes = QUICK if quick else FULL
    initialised_here = not dist.is_initialized()
    if initialised_here:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    try:
        node: Node | None = None
        if local_rank == 0:
            node = profile_node(quick, cpu_devices, node_name, nic, progress=rank == 0, slowdown=slowdown)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, node.model_dump(mode="json") if node else None)
        leaders = [r for r, item in enumerate(gathered) if item is not None]
        mine: list[PairResult] = []
        for src, dst in combinations(leaders, 2):
            if rank in (src, dst):
                result = measure_pair(rank, src, dst, sizes, device)
                if result is not None:
                    mine.append(result)
            dist.barrier()  # one pair at a time: concurrent transfers would disturb each other
        results: list[Any] = [None] * world
        dist.all_gather_object(results, mine)
    except (RuntimeError, dist.DistBackendError) as exc:  # a peer died or timed out
        raise RuntimeFailure(f"distributed profile failed on rank {rank}: {str(exc).splitlines()[0]}") from None
    finally:
        if initialised_here and dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return None
    names = unique_names([gathered[r]["name"] for r in leaders])
    nodes = [Node.model_validate({**gathered[r], "name": n}) for r, n in zip(leaders, names, strict=True)]
    by_rank = dict(zip(leaders, names, strict=True))
    pairs = [
        NodePair(a=by_rank[p.src], b=by_rank[p.dst], bandwidth=sig(p.bandwidth), latency_s=sig(p.latency_s))
        for per_rank in results for p in per_rank
    ]
    return cluster_of_nodes(nodes, name=name, description=description, pairs=pairs)

"""Measure the link between emulated CPU devices: two local processes, gloo over loopback TCP.

Emulated CPU devices are separate processes that exchange activations and gradients with
torch.distributed's gloo backend over 127.0.0.1, so that path (not a host memcpy) is their intra-node
link. Two processes are spawned (one torch thread each, a free port found by binding port 0); rank 0
times point-to-point transfers to rank 1, which echoes a 4-byte acknowledgement:
latency = half the best round trip of a small message, bandwidth = nbytes / (best round time of a
large message - that round trip). Best of a few runs after a warm-up (TCP connection set-up and window
growth), the least disturbed by other load.

On a loaded host two noisy timings can fit an impossible link (the large message's best round no slower than
the small one's: bandwidth of petabytes/s). A fit outside physical bounds (`LOOPBACK_LIMITS`) is measured
again, up to `attempts` times; if none is plausible the link class default is used and the result says so.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..errors import RuntimeFailure
from .links import INTRA_LINKS

KIB = 1024
MIB = 1024**2


@dataclass(frozen=True)
class GlooSizes:
    """Bandwidth message (bytes), latency message (bytes) and timed repeats after one warm-up."""

    nbytes: int
    small_bytes: int
    repeats: int


QUICK_GLOO = GlooSizes(nbytes=4 * MIB, small_bytes=4 * KIB, repeats=3)
FULL_GLOO = GlooSizes(nbytes=64 * MIB, small_bytes=4 * KIB, repeats=5)


@dataclass(frozen=True)
class GlooProbe:
    """Loopback gloo link between two local processes: bytes/s (one direction) and one-way latency (s).
    `fallback`: no measurement was plausible; the figures are the `shm` link class defaults."""

    bandwidth: float
    latency_s: float
    fallback: bool = False


@dataclass(frozen=True)
class LinkLimits:
    """Physical bounds of a measured link: bandwidth in bytes/s, one-way latency in seconds."""

    max_bandwidth: float
    min_latency_s: float
    max_latency_s: float

    def plausible(self, bandwidth: float, latency_s: float) -> bool:
        """True when both figures are finite and inside the bounds."""
        return (0.0 < bandwidth <= self.max_bandwidth
                and self.min_latency_s <= latency_s <= self.max_latency_s)


# Loopback TCP copies every byte at least twice through host memory (sender's and receiver's socket buffers),
# so it cannot beat a host's memory bandwidth: 100 GB/s bounds any current server. One-way latency of a
# loopback TCP message is a few microseconds at the least (two system calls and a wake-up) and well under
# a second on any host that is not swapping.
LOOPBACK_LIMITS = LinkLimits(max_bandwidth=100e9, min_latency_s=1e-6, max_latency_s=1.0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it back, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def own_process_group_env(**overrides: str) -> Iterator[None]:
    """Environment for spawned children that form a process group of their own on 127.0.0.1 (inherited at
    spawn): `overrides` set, and torchrun's TORCHELASTIC_USE_AGENT_STORE removed -- under it every rank of
    a new group connects to a store it expects torchrun's agent to host, none serves one, and the group
    times out (a `flashflex profile --distributed` worker running a local probe). Restored afterwards."""
    saved = {key: os.environ.get(key) for key in (*overrides, AGENT_STORE)}
    os.environ.pop(AGENT_STORE, None)
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def _round_trip(payload: torch.Tensor, ack: torch.Tensor) -> float:
    """Rank 0: seconds to send `payload` to rank 1 and receive its acknowledgement."""
    import torch.distributed as dist

    start = time.perf_counter()
    dist.send(payload, dst=1)
    dist.recv(ack, src=1)
    return time.perf_counter() - start


def _echo(payload: torch.Tensor, ack: torch.Tensor) -> None:
    """Rank 1: receive `payload` from rank 0 and acknowledge it."""
    import torch.distributed as dist

    dist.recv(payload, src=0)
    dist.send(ack, dst=0)


def _worker(rank: int, port: int, sizes: GlooSizes, results, timeout_s: float) -> None:  # noqa: ANN001 - a Queue
    """One of the two spawned processes; rank 0 puts (bandwidth, latency_s) on `results`."""
    import torch.distributed as dist

    from .cpu_share import pin_emulated_device

    pin_emulated_device(rank)  # as the runtime runs emulated devices: one thread on its own core
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))
    try:
        payload = torch.ones(sizes.nbytes // 4, dtype=torch.float32)
        small = torch.ones(max(sizes.small_bytes // 4, 1), dtype=torch.float32)
        ack = torch.zeros(1, dtype=torch.float32)
        rounds = sizes.repeats + 1  # one warm-up round each
        if rank == 1:
            for _ in range(rounds):
                _echo(small, ack)
            for _ in range(rounds):
                _echo(payload, ack)
        else:
            rtt = min(_round_trip(small, ack) for _ in range(rounds))
            _round_trip(payload, ack)
            best = min(_round_trip(payload, ack) for _ in range(sizes.repeats))
            spent = best - rtt
            results.put((payload.numel() * 4 / spent if spent > 0 else float("inf"), rtt / 2))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def gloo_link(sizes: GlooSizes = QUICK_GLOO, timeout_s: float = 60.0, attempts: int = 3,
              limits: LinkLimits = LOOPBACK_LIMITS) -> GlooProbe:
    """Measure gloo point-to-point over loopback TCP between two local processes; a physically impossible
    fit is measured again (at most `attempts` times), then replaced by the `shm` class default (said on
    stderr and in `GlooProbe.fallback`)."""
    seen: list[tuple[float, float]] = []
    for _ in range(attempts):
        bandwidth, latency_s = _measure_once(sizes, timeout_s)
        if limits.plausible(bandwidth, latency_s):
            return GlooProbe(bandwidth, latency_s)
        seen.append((bandwidth, latency_s))
    default = INTRA_LINKS["shm"]
    shown = "; ".join(f"{bw:.3g} B/s, {lat:.3g} s" for bw, lat in seen)
    print(f"warning: gloo loopback probe gave no plausible fit in {attempts} tries ({shown}); "
          f"using the shm class default {default.bandwidth:.3g} B/s, {default.latency_s:.3g} s",
          file=sys.stderr)
    return GlooProbe(default.bandwidth, default.latency_s, fallback=True)


def _measure_once(sizes: GlooSizes, timeout_s: float) -> tuple[float, float]:
    """One spawned measurement: (bandwidth bytes/s, one-way latency s), unchecked."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    try:
        # one thread each, set before torch loads in the children
        with own_process_group_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"):
            mp.spawn(_worker, args=(free_port(), sizes, results, timeout_s), nprocs=2, join=True)
    except Exception as exc:  # ProcessRaisedException, ProcessExitedException
        first = str(exc).strip().splitlines()
        raise RuntimeFailure(f"gloo loopback probe failed: {first[-1] if first else type(exc).__name__}") from None
    if results.empty():
        raise RuntimeFailure("gloo loopback probe failed: rank 0 reported no measurement")
    bandwidth, latency_s = results.get()
    return float(bandwidth), float(latency_s)

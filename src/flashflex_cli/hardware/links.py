"""Link classes: default bandwidth (bytes/s, one direction) and latency (seconds) per interconnect kind.

Used when a cluster file has no measurement for a pair. Figures are typical achieved rates, not
marketing peaks: NVLink 3 (A100) 300 GB/s per direction, PCIe 4.0 x16 about 25 GB/s achieved,
HDR InfiniBand 200 Gbit/s, RoCE 100 Gbit/s, commodity Ethernet 10 Gbit/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

IntraKind = Literal["nvlink", "pcie", "xgmi", "shm"]
NicKind = Literal["ib", "roce", "eth"]


@dataclass(frozen=True)
class LinkClass:
    """Defaults for one interconnect kind: bandwidth in bytes/s, latency in seconds, RDMA or not."""

    bandwidth: float
    latency_s: float
    rdma: bool = False


INTRA_LINKS: dict[str, LinkClass] = {
    "nvlink": LinkClass(300e9, 2e-6),
    "xgmi": LinkClass(100e9, 2e-6),
    "pcie": LinkClass(25e9, 5e-6),
    # Processes of one host talking through gloo over loopback TCP (the emulated CPU devices). Measured on the
    # 2-core development machine: ring all-reduce of 64 MiB at 1.5 GB/s bus bandwidth, 128 KiB in 1.6 ms
    # between 2 processes (about 0.75 ms per ring step); point-to-point 4 MiB at 2-3 GB/s.
    "shm": LinkClass(2e9, 5e-4),
}

NIC_LINKS: dict[str, LinkClass] = {
    "ib": LinkClass(25e9, 5e-6, rdma=True),
    "roce": LinkClass(12.5e9, 1e-5, rdma=True),
    "eth": LinkClass(1.25e9, 5e-5),
}


@dataclass(frozen=True)
class Link:
    """The effective link between two devices: bandwidth (bytes/s), latency (s), and its kind."""

    bandwidth: float
    latency_s: float
    kind: str

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move `nbytes` bytes over this link (alpha-beta model)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth


SAME_DEVICE = Link(float("inf"), 0.0, "self")

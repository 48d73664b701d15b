"""Several "hosts" on one machine: network namespaces joined by a bridge, optional shaped links.

Recipe: /work/shared/recipes/netns-cluster.md. Topology: one namespace per host plus one namespace
holding a Linux bridge; host i has interface `veth0` with address 10.200.77.<i+1>/24, its peer `p<i>`
sits on the bridge. Shaping host i (`shape={i: "1gbit"}`) puts a tbf qdisc on both ends of its veth
pair, so traffic to and from host i is limited and the other hosts' links stay fast. Everything lives
inside namespaces named `<prefix><pid>...`, so deleting them removes every link; nothing is added to the
root namespace. Running torchrun across these hosts needs (recipe): `--rdzv-conf=is_host=1|0`,
`--local-addr=<host addr>` and `GLOO_SOCKET_IFNAME=<host ifname>`; `NetnsHosts.torchrun_env/args` help.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from types import TracebackType

SUBNET = 77  # 10.200.77.0/24: an unusual subnet, and only ever inside our own namespaces


@dataclass(frozen=True)
class Host:
    """One namespace host: namespace name, IPv4 address (no prefix length), interface name."""

    name: str
    addr: str
    ifname: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def netns_available(prefix: str = "ffx") -> tuple[bool, str]:
    """Whether namespaces can be made here (root, `ip` and `tc` present, a test namespace works)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{prefix}{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {made.stderr.strip() or made.stdout.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(prefix: str = "ffx") -> list[str]:
    """Delete namespaces `<prefix><pid>...` whose creating process is gone; returns their names."""
    listing = _ip("netns", "list", check=False).stdout
    removed = []
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(rf"{re.escape(prefix)}(\d+)(?:h\d+|br|probe)", name)
        if match and not _pid_alive(int(match.group(1))):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class NetnsHosts:
    """Context manager: `count` namespace hosts on one bridge; `shape[i]` = tbf rate of host i's link.

    Example: `with NetnsHosts(3, shape={2: "1gbit"}) as net: subprocess.run([*net.prefix_cmd(0), "ip", "a"])`.
    """

    def __init__(self, count: int, shape: dict[int, str] | None = None, prefix: str = "ffx") -> None:
        if not 1 <= count <= 9:  # single-digit last octet keeps addresses the same length (c10d order)
            raise ValueError("NetnsHosts supports 1 to 9 hosts")
        self.count = count
        self.shape = dict(shape or {})
        for index in self.shape:
            if not 0 <= index < count:
                raise ValueError(f"shape names host {index}, there are {count}")
        self.prefix = prefix
        tag = f"{prefix}{os.getpid()}"
        self.bridge_ns = f"{tag}br"
        self.hosts = [Host(f"{tag}h{i}", f"10.200.{SUBNET}.{i + 1}", "veth0") for i in range(count)]

    # ---- commands -----------------------------------------------------------------------------
    def prefix_cmd(self, i: int) -> list[str]:
        """Command prefix that runs a program inside host i's namespace."""
        return ["ip", "netns", "exec", self.hosts[i].name]

    def torchrun_args(self, i: int, nnodes: int | None = None, nproc: int = 1, port: int = 29500,
                      rdzv_id: str = "flashflex") -> list[str]:
        """torch.distributed.run options for host i (host 0 runs the c10d rendezvous)."""
        return [
            f"--nnodes={nnodes or self.count}", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.hosts[0].addr}:{port}", f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf=is_host={1 if i == 0 else 0}", f"--local-addr={self.hosts[i].addr}",
        ]

    def torchrun_env(self, i: int, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a torchrun on host i: gloo bound to the host's interface."""
        env = dict(os.environ if base is None else base)
        env["GLOO_SOCKET_IFNAME"] = self.hosts[i].ifname
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    # ---- lifecycle ----------------------------------------------------------------------------
    def _names(self) -> list[str]:
        return [self.bridge_ns, *(h.name for h in self.hosts)]

    def create(self) -> None:
        """Create the namespaces, bridge, veth pairs, addresses and shaping."""
        clean_stale(self.prefix)
        self.remove()
        br = self.bridge_ns
        _ip("netns", "add", br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        _ip("-n", br, "link", "set", "lo", "up")
        for i, host in enumerate(self.hosts):
            peer = f"p{i}"
            _ip("netns", "add", host.name)
            _ip("link", "add", host.ifname, "netns", host.name, "type", "veth", "peer", "name", peer, "netns", br)
            _ip("-n", br, "link", "set", peer, "master", "br0")
            _ip("-n", br, "link", "set", peer, "up")
            _ip("-n", host.name, "addr", "add", f"{host.addr}/24", "dev", host.ifname)
            _ip("-n", host.name, "link", "set", "lo", "up")
            _ip("-n", host.name, "link", "set", host.ifname, "up")
            if i in self.shape:
                for ns, dev in ((host.name, host.ifname), (br, peer)):
                    subprocess.run(
                        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                         "rate", self.shape[i], "burst", "1mb", "latency", "10ms"],
                        capture_output=True, text=True, check=True, timeout=30,
                    )

    def remove(self) -> None:
        """Delete every namespace of this instance (their links go with them); idempotent."""
        existing = set(_ip("netns", "list", check=False).stdout.split())
        for name in self._names():
            if name in existing:
                _ip("netns", "del", name, check=False)

    def __enter__(self) -> NetnsHosts:
        try:
            self.create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()

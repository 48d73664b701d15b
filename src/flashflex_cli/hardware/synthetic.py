"""Synthetic clusters from the device catalog: `flashflex profile --synthetic SPEC`.

SPEC is a comma-separated list of node groups `NODESxDEVICESxTYPE[:OPTION=VALUE]...`, e.g.
`1x8xA100-80G-SXM:nic=ib,3x8x4090:nic=eth:bw=25` or `1x4xcpu:slowdown=1,1,2,4`. Options:

- `nic=ib|roce|eth`: the node's NIC class (default eth);
- `bw=GBPS`: NIC bandwidth in gigabits per second (stored as bytes/s, so 100 -> 12.5e9);
- `slowdown=a,b,...`: per-device emulation slowdown (one value per device, or one for all);
- `link=nvlink|pcie|xgmi|shm`: intra-node fabric (default: the catalog's, `shm` for cpu devices);
- `name=PREFIX`: node-name prefix for this group (nodes are PREFIX0, PREFIX1, ...).

Nodes without a prefix are named node0, node1, ... counting across the whole spec.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import get_args

from pydantic import ValidationError

from ..errors import InputError
from ..physical_limits import LINK_BANDWIDTH, SLOWDOWN
from ..validate_numbers import MAX_DEVICES, cluster_shape, positive
from .catalog import device_type
from .cluster import Cluster, Device, IntraLink, Node
from .links import IntraKind, NicKind

_GROUP = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*([^:,\s]+)\s*$")
_NUMBER = re.compile(r"^\s*[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?\s*$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_OPTIONS = ("nic", "bw", "slowdown", "link", "name")
NICS: tuple[str, ...] = get_args(NicKind)
INTRA: tuple[str, ...] = get_args(IntraKind)


@dataclass(frozen=True)
class NodeGroup:
    """`count` identical nodes of `devices` devices of catalog type `type`.

    nic_bandwidth: bytes/s or None for the NIC class default; slowdown: one factor per device.
    """

    count: int
    devices: int
    type: str
    nic: str = "eth"
    nic_bandwidth: float | None = None
    slowdown: tuple[float, ...] = field(default=())
    link: str | None = None
    name: str | None = None


def _split_groups(spec: str) -> list[str]:
    """Split SPEC at commas that start a new group (a `slowdown=` list also uses commas)."""
    if not spec.strip():
        raise InputError("empty --synthetic spec; expected e.g. '2x8xA100-80G-SXM:nic=ib,1x8x4090'")
    groups: list[str] = []
    for token in spec.split(","):
        head = token.split(":", 1)[0]
        if _GROUP.match(head):
            groups.append(token)
        elif groups and _NUMBER.match(head) and re.search(r":slowdown=[^:]*$", groups[-1]):
            groups[-1] += "," + token
        else:
            raise InputError(
                f"malformed spec group {token.strip()!r}: expected NODESxDEVICESxTYPE[:nic=..][:bw=..], "
                "e.g. '2x8xA100-80G-SXM:nic=ib'"
            )
    return groups


def _positive(text: str, what: str, group: str) -> float:
    if not _NUMBER.match(text):
        raise InputError(f"spec group {group!r}: {what} must be a positive number, got {text!r}")
    return positive(text.strip(), f"spec group {group!r}: {what}")


def _parse_group(text: str) -> NodeGroup:
    head, *options = text.strip().split(":")
    match = _GROUP.match(head)
    assert match is not None  # _split_groups guarantees it
    count, devices = cluster_shape(match.group(1), match.group(2), f"spec group {text.strip()!r}")
    kind = device_type(match.group(3))
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        key = key.strip().lower()
        if not sep or key not in _OPTIONS:
            raise InputError(f"spec group {text!r}: unknown option {option!r}; known: {', '.join(_OPTIONS)}")
        if key in values:
            raise InputError(f"spec group {text!r}: option {key!r} given twice")
        values[key] = value.strip()
    nic = values.get("nic", "eth").lower()
    if nic not in NICS:
        raise InputError(f"spec group {text!r}: nic must be one of {', '.join(NICS)}, got {nic!r}")
    link = values.get("link")
    if link is not None and link.lower() not in INTRA:
        raise InputError(f"spec group {text!r}: link must be one of {', '.join(INTRA)}, got {link!r}")
    bandwidth = None
    if "bw" in values:
        bandwidth = _positive(values["bw"], "bw (Gbit/s)", text) * 1e9 / 8
        if LINK_BANDWIDTH.problem(bandwidth) is not None:
            raise InputError(f"spec group {text!r}: bw must be from {LINK_BANDWIDTH.low * 8 / 1e9:g} to "
                             f"{LINK_BANDWIDTH.high * 8 / 1e9:g} Gbit/s, got {values['bw']}")
    slowdown: tuple[float, ...] = (1.0,) * devices
    if "slowdown" in values:
        factors = [SLOWDOWN.check(_positive(v, "slowdown", text), f"spec group {text!r}: slowdown")
                   for v in values["slowdown"].split(",")]
        if len(factors) == 1:
            factors = factors * devices
        if len(factors) != devices:
            raise InputError(
                f"spec group {text!r}: slowdown has {len(factors)} values for {devices} devices per node"
            )
        slowdown = tuple(factors)
    name = values.get("name")
    if name is not None and not _NAME.match(name):
        raise InputError(f"spec group {text!r}: name prefix {name!r} may use only letters, digits, '_.-'")
    return NodeGroup(count, devices, kind.name, nic, bandwidth, slowdown, link.lower() if link else None, name)


def parse_spec(spec: str) -> list[NodeGroup]:
    """Parse a SPEC string into node groups; malformed input raises InputError (one line)."""
    groups = [_parse_group(group) for group in _split_groups(spec)]
    cluster_shape(str(sum(g.count for g in groups)), "1", "spec")
    total = sum(g.count * g.devices for g in groups)
    if total > MAX_DEVICES:
        raise InputError(f"spec describes {total} devices, at most {MAX_DEVICES} are supported")
    return groups


def _device(type_name: str, slowdown: float) -> Device:
    kind = device_type(type_name)
    return Device(
        type=kind.name,
        memory_bytes=kind.memory_bytes,
        peak_flops=dict(kind.peak_flops),
        memory_bandwidth=kind.memory_bandwidth,
        source="catalog",
        slowdown=slowdown,
    )


def build_cluster(spec: str, name: str = "cluster", description: str | None = None) -> Cluster:
    """Build a Cluster from a SPEC string, every figure from the catalog (see module docstring)."""
    nodes: list[Node] = []
    default_index = 0
    for group in parse_spec(spec):
        kind = device_type(group.type)
        link = group.link or ("shm" if kind.name == "cpu" else kind.default_intra_link)
        for i in range(group.count):
            if group.name is None:
                node_name, default_index = f"node{default_index}", default_index + 1
            else:
                node_name = f"{group.name}{i}"
            nodes.append(
                Node(
                    name=node_name,
                    nic=group.nic,  # type: ignore[arg-type]
                    nic_bandwidth=group.nic_bandwidth,
                    devices=[_device(group.type, s) for s in group.slowdown],
                    intra_link=IntraLink(kind=link),  # type: ignore[arg-type]
                )
            )
    names = [node.name for node in nodes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"spec gives two nodes the same name: {', '.join(duplicates)}; use distinct name= prefixes")
    try:
        return Cluster(name=name, description=description, nodes=nodes)
    except ValidationError as exc:
        raise InputError(f"spec {spec!r}: {exc.errors()[0]['msg']}") from None

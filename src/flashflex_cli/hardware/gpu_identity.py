"""Which local CUDA device is a cluster file's GPU: matched by UUID or PCI bus id, not by its index.

`flashflex profile` records each GPU's UUID and PCI bus id where torch exposes them. The CUDA ordinal a process
sees depends on CUDA_VISIBLE_DEVICES (a SLURM allocation renumbers from 0) and CUDA_DEVICE_ORDER (the driver's
order by speed, or by PCI bus id), which can differ between `profile` and the run; a UUID and a bus id do not.
So the device "node/i" of a plan runs on the visible ordinal whose UUID (else bus id) is the one recorded for
it, and on ordinal i only where the cluster file records neither (files written before these fields, synthetic
clusters). `cuda_ordinal` is that choice, a pure function of the recorded identity and the visible devices'
(`LocalGpu`, read by `visible_gpus`); it is the only place that makes it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import InputError


def normal_uuid(text: str | None) -> str | None:
    """A GPU UUID in one spelling: lower case, without the "GPU-" prefix nvidia-smi and CUDA_VISIBLE_DEVICES
    show (None for None or an empty text)."""
    if not text:
        return None
    text = text.strip().lower()
    return text.removeprefix("gpu-") or None


def pci_bus_id(domain: int, bus: int, device: int) -> str:
    """The PCI address "DDDD:BB:DD" of a GPU (hexadecimal, lower case; the function number is left out: a GPU is
    function 0)."""
    return f"{domain:04x}:{bus:02x}:{device:02x}"


def normal_bus_id(text: str | None) -> str | None:
    """A PCI bus id in `pci_bus_id`'s spelling: accepts nvidia-smi's "00000000:3B:00.0" too (None for None)."""
    if not text:
        return None
    parts = text.strip().lower().split(".")[0].split(":")
    if len(parts) != 3:
        return text.strip().lower()
    try:
        domain, bus, device = (int(part, 16) for part in parts)
    except ValueError:
        return text.strip().lower()
    return pci_bus_id(domain, bus, device)


@dataclass(frozen=True)
class LocalGpu:
    """One CUDA device visible to this process: its ordinal, UUID and PCI bus id (None where torch does not
    expose them)."""

    ordinal: int
    uuid: str | None = None
    bus_id: str | None = None


def cuda_ordinal(device_id: str, uuid: str | None, bus_id: str | None, index: int,
                 visible: Sequence[LocalGpu]) -> int:
    """The visible CUDA ordinal that runs plan device `device_id`, recorded with `uuid` and `bus_id` (either may be
    None) at index `index` of its node. InputError, one line, when the recorded device is not visible here."""
    want_uuid, want_bus = normal_uuid(uuid), normal_bus_id(bus_id)
    if want_uuid is not None and any(gpu.uuid is not None for gpu in visible):
        found = [gpu.ordinal for gpu in visible if normal_uuid(gpu.uuid) == want_uuid]
        what = f"GPU-{want_uuid}"
    elif want_bus is not None and any(gpu.bus_id is not None for gpu in visible):
        found = [gpu.ordinal for gpu in visible if normal_bus_id(gpu.bus_id) == want_bus]
        what = f"PCI {want_bus}"
    else:
        if index >= len(visible):
            raise InputError(f"{device_id} (cuda:{index}) is not visible here: {_visible_text(visible)}")
        return index
    if not found:
        raise InputError(f"{device_id} is {what} in the cluster file, and no visible CUDA device is: "
                         f"{_visible_text(visible)}")
    return found[0]


def _visible_text(visible: Sequence[LocalGpu]) -> str:
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = f"CUDA_VISIBLE_DEVICES={mask!r}, " if mask is not None else ""
    names = ", ".join(f"cuda:{g.ordinal} {('GPU-' + normal_uuid(g.uuid)) if g.uuid else (g.bus_id or '?')}"
                      for g in visible)
    return f"{shown}{len(visible)} visible ({names or 'none'})"


def visible_gpus() -> list[LocalGpu]:
    """The CUDA devices this process sees, with the identity torch exposes (UUID; PCI domain, bus and device
    numbers in newer versions)."""
    import torch

    out = []
    for ordinal in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(ordinal)
        uuid = getattr(props, "uuid", None)
        numbers = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
        bus = pci_bus_id(*numbers) if all(isinstance(n, int) for n in numbers) else None  # type: ignore[arg-type]
        out.append(LocalGpu(ordinal, normal_uuid(str(uuid)) if uuid is not None else None, bus))
    return out

"""The host share of one emulated CPU device: one intra-op thread, pinned to one core.

An emulated device must run at the same speed whatever else the host runs and however many devices the
plan uses, or no measured-vs-predicted figure means anything: a lone process left to its default threads
spreads over every core and runs faster than the device it stands for. So every emulated device, in the
runtime and in `flashflex profile`, is one thread on one core: core = device index mod the usable cores.
The cluster probe measures the matmul rate and memory bandwidth the same way (one thread, one core), so a
CPU device's measured peak is a one-core figure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def usable_cores() -> list[int]:
    """The cores this process may run on, sorted (Linux affinity mask; all CPUs elsewhere)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def core_for_device(device_index: int, cores: list[int] | None = None) -> int:
    """The core emulated device `device_index` (its index on its node) runs on."""
    found = cores if cores is not None else usable_cores()
    return found[device_index % len(found)]


def core_loads(device_slowdowns: list[tuple[int, float]], cores: list[int] | None = None) -> dict[int, float]:
    """Busy fraction each host core must give the emulated devices pinned to it: a device of slowdown s
    computes 1/s of the time (it sleeps the rest, runtime/device/slowdown.py). `device_slowdowns`: (device_index as
    core_for_device takes it, slowdown) per emulated device that runs on this host. Above 1, the devices of that
    core run slower than emulated, by about that factor."""
    found = cores if cores is not None else usable_cores()
    loads: dict[int, float] = {}
    for index, slowdown in device_slowdowns:
        core = core_for_device(index, found)
        loads[core] = loads.get(core, 0.0) + 1.0 / max(1.0, slowdown)
    return loads


def _hold_one_core(core: int) -> None:
    """One intra-op thread, and this process (all its threads) on `core` where the OS allows pinning."""
    import torch

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def pin_emulated_device(device_index: int, cores: list[int] | None = None) -> int:
    """Hold this process to one intra-op thread on the device's core; returns the core.

    Call before the first parallel torch op (inter-op threads cannot change after that)."""
    import torch

    core = core_for_device(device_index, cores)
    _hold_one_core(core)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran: intra-op threads still apply
        pass
    return core


@contextmanager
def as_emulated_device(device_index: int = 0, cores: list[int] | None = None) -> Iterator[int]:
    """Run the body on emulated device `device_index`'s share (one thread, its core); yields the core.

    For measurements inside a longer-lived process (the cluster probe): the process's intra-op thread count
    and affinity are restored on exit. Inter-op threads are left alone (they cannot be changed back)."""
    import torch

    threads = torch.get_num_threads()
    affinity = usable_cores()
    core = core_for_device(device_index, affinity if cores is None else cores)
    try:
        _hold_one_core(core)
        yield core
    finally:
        torch.set_num_threads(threads)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(affinity))

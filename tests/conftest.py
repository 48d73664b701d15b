"""Shared pytest fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.infra.netns import NetnsHosts, netns_available

REPO = Path(__file__).resolve().parents[1]
FLASHFLEX = str(Path(sys.executable).with_name("flashflex"))


@pytest.fixture(autouse=True)
def _one_thread_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep multi-process tests from oversubscribing the 2-core CI machine."""
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))


@pytest.fixture
def repo() -> Path:
    """The repository root."""
    return REPO


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A one-process gloo group in this process (rank 0 of 1: DCP save/load and the engine's reductions are
    collectives), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def net() -> Iterator[NetnsHosts]:
    """Two network-namespace hosts on one bridge (tests/infra/netns.py); skips where namespaces cannot be made."""
    ok, why = netns_available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    with NetnsHosts(2) as hosts:
        yield hosts

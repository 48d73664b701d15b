"""An emulated CPU device is one intra-op thread pinned to one core, in the worker and in the cluster probe."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from flashflex_cli.hardware import probe_local
from flashflex_cli.hardware.cpu_share import as_emulated_device, core_for_device, usable_cores
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.runtime.training.worker import host_device_index

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")

# What a worker rank does before any torch work, in a fresh process; prints its threads and cores.
_WORKER_SHARE = """
import json, os, sys, torch
from flashflex_cli.runtime.training.worker import claim_host_share
claim_host_share(on_cpu=True, device_index=int(sys.argv[1]))
torch.mm(torch.ones(64, 64), torch.ones(64, 64))
print(json.dumps({"threads": torch.get_num_threads(), "cores": sorted(os.sched_getaffinity(0))}))
"""


def test_devices_take_cores_round_robin() -> None:
    assert [core_for_device(i, [4, 6]) for i in range(5)] == [4, 6, 4, 6, 4]
    assert core_for_device(3, [5]) == 5


def test_the_core_index_is_the_position_among_the_clusters_devices() -> None:
    cluster = build_cluster("2x2xcpu")
    first, second = cluster.nodes[0].name, cluster.nodes[1].name
    # a node's devices get consecutive (distinct) indices; nodes emulated on one machine do not share cores
    assert host_device_index(cluster, f"{first}/1", None) == 1
    assert host_device_index(cluster, f"{second}/0", second) == 2
    assert host_device_index(cluster, f"{second}/1", second) == 3


@needs_affinity
@pytest.mark.parametrize("device_index", [0, 1])
def test_a_cpu_worker_runs_one_thread_on_its_devices_core(device_index: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # a user setting does not change the device model
    done = subprocess.run([sys.executable, "-c", _WORKER_SHARE, str(device_index)], env=env, check=True,
                          capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"threads": 1, "cores": [core_for_device(device_index, usable_cores())]}


@needs_affinity
def test_a_scoped_share_is_given_back() -> None:
    threads, cores = torch.get_num_threads(), usable_cores()
    with as_emulated_device(1) as core:
        assert core == core_for_device(1, cores)
        assert (torch.get_num_threads(), os.sched_getaffinity(0)) == (1, {core})
    assert (torch.get_num_threads(), usable_cores()) == (threads, cores)


@needs_affinity
def test_the_cpu_probe_measures_one_pinned_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, set[int]]] = []

    def record(*_args: object) -> float:
        seen.append((torch.get_num_threads(), os.sched_getaffinity(0)))
        return 1e9

    monkeypatch.setattr(probe_local, "matmul_flops", record)
    monkeypatch.setattr(probe_local, "memory_bandwidth", record)
    node = probe_local.probe_node(quick=True, cpu_devices=1, progress=False)
    assert seen == [(1, {core_for_device(0, usable_cores())})] * 2
    assert node.kind == "cpu" and node.devices[0].matmul_flops == 1e9

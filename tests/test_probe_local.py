"""Local probe: real quick measurements on CPU, GPU-name matching, probe -> Node conversion."""

from __future__ import annotations

import os

import pytest
import torch

from flashflex_cli.cli import main
from flashflex_cli.errors import RuntimeFailure
from flashflex_cli.hardware import probe_gloo, probe_local
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.hardware.probe_gloo import GlooProbe, free_port, gloo_link
from flashflex_cli.hardware.probe_local import (
    CopyProbe,
    DeviceProbe,
    NodeProbe,
    catalog_match,
    copy_bandwidth,
    default_node_name,
    host_memory_bytes,
    matmul_flops,
    memory_bandwidth,
    node_from_probe,
    probe_node,
    sig,
)
from flashflex_cli.hardware.probe_network import unique_names

GIB = 1024**3
CPU = torch.device("cpu")


def test_matmul_rate_is_plausible():
    rate = matmul_flops(CPU, torch.float32, 256, repeats=3)
    # a CPU core does between 0.1 and 1000 GFLOP/s (the best of 3 runs, so other load rarely halves it)
    assert 1e8 < rate < 1e12


def test_matmul_rate_counts_two_n_cubed_flop(monkeypatch):
    calls = []

    def fixed_time(fn, device, repeats):
        fn()
        calls.append(repeats)
        return 0.5

    monkeypatch.setattr(probe_local, "_best_time", fixed_time)
    assert matmul_flops(CPU, torch.float32, 64, repeats=4) == 2 * 64**3 / 0.5
    assert calls == [4]


def test_memory_and_copy_bandwidth_are_plausible():
    rate = memory_bandwidth(CPU, 8 * 2**20, repeats=3)
    copy = copy_bandwidth(CPU, CPU, 8 * 2**20, repeats=3)
    assert 1e8 < rate < 1e13 and 1e8 < copy < 1e13


def test_host_memory_matches_meminfo():
    with open("/proc/meminfo") as handle:
        total_kib = int(next(line for line in handle if line.startswith("MemTotal:")).split()[1])
    assert host_memory_bytes() == total_kib * 1024


def test_quick_cpu_probe_describes_shared_host():
    probe = probe_node(quick=True, cpu_devices=3, progress=False)
    assert probe.kind == "cpu" and len(probe.devices) == 3
    node = node_from_probe(probe, node_name="here")
    assert node.name == "here" and node.hostname == probe.hostname
    # gloo over loopback TCP between two processes: 0.05-50 GB/s, 1 us - 100 ms per message
    link = node.intra_link
    assert link.kind == "shm" and probe_gloo.LOOPBACK_LIMITS.plausible(link.bandwidth, link.latency_s)
    assert (link.bandwidth, link.latency_s) == (sig(probe.gloo.bandwidth), sig(probe.gloo.latency_s))
    total = sum(d.memory_bytes for d in node.devices)
    assert host_memory_bytes() - 3 < total <= host_memory_bytes()
    for device in node.devices:
        assert device.source == "measured" and device.type == "cpu"
        assert device.peak_flops == device.achieved_flops and device.peak_flops["fp32"] > 1e8


def test_one_cpu_device_has_no_link_and_spawns_nothing(monkeypatch):
    def no_spawn(*_args, **_kwargs):
        raise AssertionError("one emulated device has no inter-process link to measure")

    monkeypatch.setattr(probe_local, "gloo_link", no_spawn)
    probe = probe_node(quick=True, cpu_devices=1, progress=False)
    assert probe.gloo is None
    link = node_from_probe(probe).intra_link
    assert link.kind == "shm" and link.bandwidth is None and link.latency_s is None


def test_cpu_link_is_the_gloo_measurement_not_a_memcpy(monkeypatch):
    calls = []

    def fake_gloo(sizes):
        calls.append(sizes)
        return GlooProbe(bandwidth=1.23456e9, latency_s=4.56789e-4)

    monkeypatch.setattr(probe_local, "gloo_link", fake_gloo)
    quick = node_from_probe(probe_node(quick=True, cpu_devices=2, progress=False))
    assert quick.intra_link.model_dump() == {"kind": "shm", "bandwidth": 1.235e9, "latency_s": 4.568e-4}
    assert calls == [probe_gloo.QUICK_GLOO]
    assert probe_gloo.QUICK_GLOO.nbytes < probe_gloo.FULL_GLOO.nbytes == 64 * 2**20


def test_gloo_probe_failure_is_one_line(monkeypatch):
    import torch.multiprocessing as mp

    def dead(*_args, **_kwargs):
        raise mp.ProcessExitedException("process 1 terminated with exit code 1", error_index=1, error_pid=4242, exit_code=1)

    monkeypatch.setattr(mp, "spawn", dead)
    with pytest.raises(RuntimeFailure, match="gloo loopback probe failed: process 1 terminated"):
        gloo_link()


def test_impossible_gloo_fit_is_measured_again(monkeypatch):
    fits = iter([(4.2e15, 3e-5), (2e9, -1e-6), (2.5e9, 6e-5)])  # 4 PB/s; negative latency; plausible
    monkeypatch.setattr(probe_gloo, "_measure_once", lambda sizes, timeout_s: next(fits))
    assert gloo_link() == GlooProbe(2.5e9, 6e-5, fallback=False)


def test_no_plausible_gloo_fit_falls_back_to_the_class_default_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(probe_gloo, "_measure_once", lambda sizes, timeout_s: (float("inf"), 1e-5))
    found = gloo_link(attempts=2)
    default = probe_gloo.INTRA_LINKS["shm"]
    assert found == GlooProbe(default.bandwidth, default.latency_s, fallback=True)
    err = capsys.readouterr().err
    assert "no plausible fit in 2 tries" in err and "shm class default" in err


def test_gloo_probe_inside_a_torchrun_worker_serves_its_own_store(monkeypatch):
    """Under torchrun (`profile --distributed` with several CPU devices per host) the worker's environment says
    TORCHELASTIC_USE_AGENT_STORE=True; spawned probe ranks inheriting it would all wait for an agent's store
    that never comes. The probe's children form their own group, and the worker's environment is restored."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    probe = gloo_link(timeout_s=30, attempts=1)
    assert probe.bandwidth > 0 and probe.latency_s > 0
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert os.environ["OMP_NUM_THREADS"] == "2"


def test_free_port_is_bindable():
    import socket

    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_profile_command_quick_on_cpu(tmp_path, capsys):
    out = tmp_path / "me.json"
    assert main(["profile", "--quick", "--cpu-devices", "2", "--node-name", "box", "--nic", "roce",
                 "--out", str(out)]) == 0
    cluster = load_cluster(out)
    assert [n.name for n in cluster.nodes] == ["box"] and cluster.nodes[0].nic == "roce"
    assert len(cluster.device_ids) == 2 and cluster.device("box/1").source == "measured"
    captured = capsys.readouterr()
    assert "probing" in captured.err and "box" in captured.out  # progress on stderr, the summary on stdout


def test_profile_command_rejects_bad_options(tmp_path, capsys):
    assert main(["profile", "--quick", "--nic", "wifi", "--out", str(tmp_path / "x.json")]) == 2
    assert main(["profile", "--quick", "--node-name", "a b", "--out", str(tmp_path / "x.json")]) == 2
    assert main(["profile", "--quick", "--cpu-devices", "0", "--out", str(tmp_path / "x.json")]) == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "memory_gib", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", 80, "A100-80G-SXM"),
        ("NVIDIA A100-SXM4-40GB", 40, "A100-40G-SXM"),
        ("NVIDIA A100-PCIE-40GB", 40, "A100-40G-PCIe"),
        ("NVIDIA A100 80GB PCIe", 80, "A100-80G-PCIe"),
        ("NVIDIA H100 80GB HBM3", 80, "H100-SXM"),
        ("NVIDIA H100 PCIe", 80, "H100-PCIe"),
        ("NVIDIA H100 NVL", 94, "H100-NVL"),
        ("NVIDIA H200", 141, "H200"),
        ("NVIDIA GeForce RTX 4090", 24, "RTX-4090"),
        ("NVIDIA GeForce RTX 3080 Ti", 12, "RTX-3080Ti"),
        ("NVIDIA GeForce RTX 3090", 24, "RTX-3090"),
        ("NVIDIA L40S", 48, "L40S"),
        ("NVIDIA L4", 24, "L4"),
        ("NVIDIA A10G", 24, "A10G"),
        ("Tesla V100-SXM2-32GB", 32, "V100-32G"),
        ("Tesla T4", 16, "T4"),
        ("AMD Instinct MI300X", 192, "MI300X"),
        ("NVIDIA GeForce GTX 1080", 8, None),
    ],
)
def test_catalog_match(name, memory_gib, expected):
    assert catalog_match(name, memory_gib * GIB) == expected


def test_gpu_probe_becomes_node_with_catalog_peaks_and_measured_pairs():
    probe = NodeProbe(
        hostname="gpu-host.example.org",
        kind="cuda",
        devices=[DeviceProbe(i, "NVIDIA A100-SXM4-80GB", "bf16", 2.5e14, 80 * GIB, 1.7e12) for i in range(2)]
        + [DeviceProbe(2, "Mystery GPU", "bf16", 1.0e14, 16 * GIB, 5e11)],
        copies=[CopyProbe(0, 1, 2.3e11), CopyProbe(0, 2, 2.0e10), CopyProbe(1, 2, 2.1e10)],
    )
    node = node_from_probe(probe)
    assert node.name == "gpu-host" and node.hostname == "gpu-host.example.org"
    a100 = node.devices[0]
    assert a100.type == "A100-80G-SXM" and a100.peak_flops["bf16"] == 312e12
    assert a100.achieved_flops == {"bf16": 2.5e14} and a100.source == "measured"
    mystery = node.devices[2]
    assert mystery.type == "Mystery-GPU" and mystery.peak_flops == {"bf16": 1e14}
    assert node.intra_link.kind == "pcie" and node.intra_link.bandwidth == 2.0e10
    assert [(p.a, p.b, p.bandwidth) for p in node.intra_pairs] == [(0, 1, 2.3e11), (0, 2, 2e10), (1, 2, 2.1e10)]


@pytest.mark.parametrize(("hostname", "kept"), [("worker_7.cluster.local", True), ("My Mac", False),
                                                ("a;rm -rf x", False)])
def test_a_hostname_no_script_could_address_is_left_out(hostname: str, kept: bool) -> None:
    probe = NodeProbe(hostname=hostname, kind="cuda",
                      devices=[DeviceProbe(0, "NVIDIA A100-SXM4-80GB", "bf16", 2.5e14, 80 * GIB, 1.7e12)], copies=[])
    node = node_from_probe(probe, node_name="n0")
    assert node.hostname == (hostname if kept else None)


def test_helpers():
    assert sig(123456789.0) == 123500000.0
    assert default_node_name("worker_7.cluster.local") == "worker_7"
    assert default_node_name("###") == "node"
    assert unique_names(["a", "b", "a"]) == ["a-0", "b", "a-2"]

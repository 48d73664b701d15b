"""Ring all-reduce and stage-to-stage transfers over real links."""

from __future__ import annotations

import pytest

from flashflex_cli.cost.comm import allreduce_time, p2p_time, ring_allreduce_seconds, transfer_time
from flashflex_cli.cost.params import CostParams
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import TrainConfig

from .cost_fixtures import cluster


def test_ring_formula() -> None:
    assert ring_allreduce_seconds(1, 1e9, 1e9, 1e-3) == 0.0
    # 4 ranks: 6 steps, each moving a quarter of the data
    assert ring_allreduce_seconds(4, 4e9, 1e9, 1e-3) == pytest.approx(6e-3 + 6.0)


def test_allreduce_uses_slowest_hop() -> None:
    c = cluster(("A100-80G-SXM", 2, "ib", "nvlink"), ("A100-80G-SXM", 2, "ib", "nvlink"))
    params = CostParams()
    inside = allreduce_time(c, ["node0/0", "node0/1"], 1e9, params)
    across = allreduce_time(c, ["node0/0", "node0/1", "node1/0", "node1/1"], 1e9, params)
    assert inside == pytest.approx(2 * 2e-6 + 1e9 / 300e9)
    assert across == pytest.approx(6 * 5e-6 + 1.5e9 / 25e9)  # HDR InfiniBand class, 25 GB/s
    half = CostParams.from_overrides({"tp_comm_efficiency": 0.5})
    assert allreduce_time(c, ["node0/0", "node0/1"], 1e9, half) == pytest.approx(2 * 2e-6 + 1e9 / 150e9)


def test_p2p_between_nodes_and_with_tp_change() -> None:
    """Lean transfers (the runtime's default): the bf16 tensor is cut into lcm(t, t') chunks, chunk k from
    source k % t to destination k % t' (sends sharing a channel queue, distinct channels run in parallel), then
    the destination group all-gathers: (t' - 1) hops of latency + nbytes / t' over its slowest link."""
    c = cluster(("RTX-4090", 4, "eth", "pcie"), ("RTX-4090", 4, "eth", "pcie"))
    model, train, params = PRESETS["llama2-7b"], TrainConfig(global_batch=4, seq_len=4096), CostParams()
    nbytes = 4096 * 4096 * 2  # bf16, the compute dtype
    local = p2p_time(c, ["node0/0"], ["node0/1"], model, train, params, micro_batch_size=1)
    remote = p2p_time(c, ["node0/0"], ["node1/0"], model, train, params, micro_batch_size=1)
    assert local == pytest.approx(5e-6 + nbytes / 25e9)
    assert remote == pytest.approx(5e-5 + nbytes / 1.25e9)
    gather2 = 5e-6 + nbytes / 2 / 25e9  # all-gather among 2 devices over PCIe
    # TP 1 -> TP 2 across nodes: two half-size chunks share the NIC pair, then the receivers gather
    assert p2p_time(c, ["node0/0"], ["node1/0", "node1/1"], model, train, params, micro_batch_size=1) == pytest.approx(
        2 * 5e-5 + nbytes / 1.25e9 + gather2)
    # TP 2 -> TP 2 inside a node: each source sends its half over its own link, in parallel
    assert p2p_time(c, ["node0/0", "node0/1"], ["node0/2", "node0/3"], model, train, params, micro_batch_size=1) == pytest.approx(
        5e-6 + nbytes / 2 / 25e9 + gather2)
    # TP 2 -> TP 2 across nodes: one tensor crosses the NIC pair (in two chunks), not two copies
    assert p2p_time(c, ["node0/0", "node0/1"], ["node1/0", "node1/1"], model, train, params, micro_batch_size=1) == pytest.approx(
        2 * 5e-5 + nbytes / 1.25e9 + gather2)
    # TP 2 -> TP 3 across nodes: 6 chunks of a sixth over the NIC pair, then a 3-device gather
    assert p2p_time(c, ["node0/0", "node0/1"], ["node1/0", "node1/1", "node1/2"], model, train,
                    params, micro_batch_size=1) == pytest.approx(6 * 5e-5 + nbytes / 1.25e9 + 2 * (5e-6 + nbytes / 3 / 25e9))
    # TP 2 -> TP 1 inside a node: two senders, one chunk each, over their own links; no gather
    assert p2p_time(c, ["node0/0", "node0/1"], ["node0/2"], model, train, params, micro_batch_size=1) == pytest.approx(
        5e-6 + nbytes / 2 / 25e9)
    # larger micro-batch, proportionally more bytes
    assert p2p_time(c, ["node0/0"], ["node1/0"], model, train, params, micro_batch_size=2) == pytest.approx(
        5e-5 + 2 * nbytes / 1.25e9)


def test_p2p_element_bytes_follow_the_runtime() -> None:
    """fp32 / tf32 training sends 4 bytes per element, bf16 and fp16 2 (the runtime computes under autocast and
    sends in the compute dtype on every device, emulated CPU devices too); the TP all-gather runs at the TP
    efficiency."""
    model = PRESETS["llama2-7b"]
    gpu = cluster(("RTX-4090", 3, "eth", "pcie"))
    for dtype, size in (("bf16", 2), ("fp16", 2), ("fp32", 4), ("tf32", 4)):
        train = TrainConfig(global_batch=4, seq_len=4096, dtype=dtype)
        assert p2p_time(gpu, ["node0/0"], ["node0/1"], model, train, CostParams(), micro_batch_size=1) == pytest.approx(
            5e-6 + 4096 * 4096 * size / 25e9)
    cpu = cluster(("cpu", 2, "eth", "shm"), ("cpu", 2, "eth", "shm"))
    train = TrainConfig(global_batch=4, seq_len=4096, dtype="bf16")
    numel = 4096 * 4096
    one = p2p_time(cpu, ["node0/0"], ["node1/0"], model, train, CostParams(), micro_batch_size=1)
    link = transfer_time(cpu, ["node0/0"], ["node1/0"], numel * 2)
    assert one == pytest.approx(link)
    half = CostParams.from_overrides({"tp_comm_efficiency": 0.5})
    full_eff = p2p_time(gpu, ["node0/0"], ["node0/1", "node0/2"], model, train, CostParams(), micro_batch_size=1)
    half_eff = p2p_time(gpu, ["node0/0"], ["node0/1", "node0/2"], model, train, half, micro_batch_size=1)
    assert half_eff - full_eff == pytest.approx(numel * 2 / 2 / 25e9)  # the gather's bandwidth term doubles


def test_full_copies_when_lean_is_off() -> None:
    """lean=False charges what the runtime does with --no-lean-p2p: every destination receives the whole
    tensor at activation_transfer_bytes (4: fp32) from source j % t."""
    c = cluster(("RTX-4090", 4, "eth", "pcie"), ("RTX-4090", 4, "eth", "pcie"))
    model, train, params = PRESETS["llama2-7b"], TrainConfig(global_batch=4, seq_len=4096), CostParams()
    nbytes = 4096 * 4096 * 4
    remote = p2p_time(c, ["node0/0"], ["node1/0"], model, train, params, lean=False, micro_batch_size=1)
    assert remote == pytest.approx(5e-5 + nbytes / 1.25e9)
    # TP 1 -> TP 2 across nodes: both copies share the NIC pair
    assert p2p_time(c, ["node0/0"], ["node1/0", "node1/1"], model, train, params, lean=False, micro_batch_size=1) == pytest.approx(
        2 * remote)
    # TP 2 -> TP 2 inside a node: two source devices send in parallel
    assert p2p_time(c, ["node0/0", "node0/1"], ["node0/2", "node0/3"], model, train, params,
                    lean=False, micro_batch_size=1) == pytest.approx(5e-6 + nbytes / 25e9)
    # the same boundary across nodes costs the lean path less than half: half the bytes, one copy
    lean = p2p_time(c, ["node0/0", "node0/1"], ["node1/0", "node1/1"], model, train, params, micro_batch_size=1)
    full = p2p_time(c, ["node0/0", "node0/1"], ["node1/0", "node1/1"], model, train, params, lean=False, micro_batch_size=1)
    assert lean < 0.3 * full
    half = CostParams.from_overrides({"activation_transfer_bytes": 2})
    assert p2p_time(c, ["node0/0"], ["node0/1"], model, train, half, lean=False, micro_batch_size=1) == pytest.approx(
        5e-6 + 4096 * 4096 * 2 / 25e9)


def test_transfer_of_nothing_is_free() -> None:
    c = cluster(("T4", 2, "eth", "pcie"))
    assert transfer_time(c, ["node0/0"], ["node0/1"], 0.0) == 0.0

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
    c = cluster(("RTX-4090", 4, "eth", "pcie"), ("RTX-4090", 4, "eth", "pcie"))
    model, train, params = PRESETS["llama2-7b"], TrainConfig(global_batch=4, seq_len=4096), CostParams()
    nbytes = 4096 * 4096 * 4  # activation_transfer_bytes: the runtime sends fp32
    local = p2p_time(c, ["node0/0"], ["node0/1"], model, train, params)
    remote = p2p_time(c, ["node0/0"], ["node1/0"], model, train, params)
    assert local == pytest.approx(5e-6 + nbytes / 25e9)
    assert remote == pytest.approx(5e-5 + nbytes / 1.25e9)
    # TP 1 -> TP 2 across nodes: both copies share the NIC pair
    assert p2p_time(c, ["node0/0"], ["node1/0", "node1/1"], model, train, params) == pytest.approx(2 * remote)
    # TP 2 -> TP 2 inside a node: two source devices send in parallel
    assert p2p_time(c, ["node0/0", "node0/1"], ["node0/2", "node0/3"], model, train, params) == pytest.approx(local)
    # larger micro-batch, proportionally more bytes
    assert p2p_time(c, ["node0/0"], ["node1/0"], model, train, params, micro_batch_size=2) == pytest.approx(
        5e-5 + 2 * nbytes / 1.25e9)


def test_transfer_bytes_is_a_parameter() -> None:
    c = cluster(("RTX-4090", 2, "eth", "pcie"))
    model, train = PRESETS["llama2-7b"], TrainConfig(global_batch=4, seq_len=4096)
    half = CostParams.from_overrides({"activation_transfer_bytes": 2})
    assert p2p_time(c, ["node0/0"], ["node0/1"], model, train, half) == pytest.approx(5e-6 + 4096 * 4096 * 2 / 25e9)


def test_transfer_of_nothing_is_free() -> None:
    c = cluster(("T4", 2, "eth", "pcie"))
    assert transfer_time(c, ["node0/0"], ["node0/1"], 0.0) == 0.0

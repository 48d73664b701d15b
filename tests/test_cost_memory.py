"""Memory per device: model states, 1F1B activations, recompute, embedding/head, logits, capacity."""

from __future__ import annotations

import pytest

from flashflex_cli.cost.memory import device_capacity, device_reserve, stage_memory
from flashflex_cli.cost.params import CostParams
from flashflex_cli.model import flops as F
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import TrainConfig

from .cost_fixtures import cluster

MODEL = PRESETS["llama2-7b"]
TRAIN = TrainConfig(global_batch=16, seq_len=4096)


def test_mixed_precision_adam_is_16_bytes_per_param() -> None:
    params = CostParams()
    mem = stage_memory(MODEL, TRAIN, 1, 4, False, False, 1, params)
    n = 4 * F.layer_params(MODEL)
    assert (mem.weights, mem.grads, mem.master, mem.optimizer) == (2 * n, 2 * n, 4 * n, 8 * n)
    assert mem.embedding_head == 0 and mem.logits == 0
    assert mem.reserve == params.memory_reserve_bytes
    assert mem.total == pytest.approx(sum(v for k, v in mem.as_dict().items() if k != "total"))


def test_fp32_training_has_no_master_copy() -> None:
    mem = stage_memory(MODEL, TrainConfig(global_batch=16, seq_len=4096, dtype="fp32"), 1, 1, False, False, 1,
                       CostParams())
    n = F.layer_params(MODEL)
    assert (mem.weights, mem.grads, mem.master, mem.optimizer) == (4 * n, 4 * n, 0, 8 * n)


def test_activations_scale_with_in_flight_and_tp() -> None:
    params = CostParams()
    one = stage_memory(MODEL, TRAIN, 1, 8, False, False, 1, params)
    four = stage_memory(MODEL, TRAIN, 1, 8, False, False, 4, params)
    assert four.activations == pytest.approx(4 * one.activations)
    assert one.activations == pytest.approx(8 * F.layer_activation_bytes(MODEL, 1, 4096, 1, "bf16"))
    tp2 = stage_memory(MODEL, TRAIN, 2, 8, False, False, 1, params)
    assert one.activations / 2 < tp2.activations < one.activations  # norms' inputs stay replicated
    assert tp2.weights == pytest.approx(8 * F.layer_params_per_device(MODEL, 2) * 2)


def test_recompute_keeps_layer_inputs_plus_one_layer() -> None:
    params = CostParams()
    train = TrainConfig(global_batch=16, seq_len=4096, recompute=True)
    mem = stage_memory(MODEL, train, 1, 16, False, False, 4, params)
    expected = 4 * 16 * F.layer_input_bytes(MODEL, 1, 4096) + F.layer_activation_bytes(MODEL, 1, 4096)
    assert mem.activations == pytest.approx(expected)
    assert mem.activations < stage_memory(MODEL, TRAIN, 1, 16, False, False, 4, params).activations / 5


def test_first_and_last_stage_hold_embedding_head_and_logits() -> None:
    params = CostParams()
    first = stage_memory(MODEL, TRAIN, 2, 4, True, False, 4, params)
    last = stage_memory(MODEL, TRAIN, 2, 4, False, True, 1, params)
    embed = F.embedding_params(MODEL) / 2
    assert first.embedding_head == pytest.approx(16 * embed)
    assert last.embedding_head == pytest.approx(16 * (embed + MODEL.hidden_size))
    assert first.logits == 0 and last.logits == F.logits_bytes(MODEL, 1, 4096, 2, "bf16")


def test_activation_factor_and_reserve_overrides() -> None:
    params = CostParams.from_overrides({"activation_bytes_factor": 1.5, "memory_reserve_bytes": 0})
    base = stage_memory(MODEL, TRAIN, 1, 2, False, False, 2, CostParams())
    more = stage_memory(MODEL, TRAIN, 1, 2, False, False, 2, params)
    assert more.activations == pytest.approx(1.5 * base.activations)
    assert more.reserve == 0
    assert stage_memory(MODEL, TRAIN, 1, 2, False, False, 2, params, reserve_bytes=123.0).reserve == 123.0


def test_llama2_7b_on_one_a100_does_not_fit_but_on_eight_stages_does() -> None:
    c = cluster(("A100-80G-SXM", 8, "ib", "nvlink"))
    params = CostParams()
    capacity = device_capacity(c, "node0/0", params)
    assert capacity == pytest.approx(80 * 1024**3 * 0.95)
    whole = stage_memory(MODEL, TRAIN, 1, 32, True, True, 1, params)
    assert whole.total > capacity  # 7B x 16 bytes = 108 GB of model states alone
    worst = max(stage_memory(MODEL, TRAIN, 1, 4, s == 0, s == 7, 8 - s, params).total for s in range(8))
    assert worst < capacity


def test_cpu_devices_get_the_cpu_reserve() -> None:
    c = cluster(("cpu", 2, "eth", "shm"), ("T4", 1, "eth", "pcie"))
    params = CostParams()
    assert device_reserve(c, "node0/0", params) == params.cpu_memory_reserve_bytes
    assert device_reserve(c, "node1/0", params) == params.memory_reserve_bytes

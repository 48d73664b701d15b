"""Memory per device as the runtime allocates it: fp32 states, saved tensors per micro-batch in flight, the step's
peak moments, the runtime paths (optimizer, recompute), TP, the embedding and head, capacity and reserve.
(tests/test_memory_tracked.py and test_cost_activations.py hold the counts to the runtime's real tensors.)"""

from __future__ import annotations

import dataclasses

import pytest

from flashflex_cli.cost import activations as A
from flashflex_cli.cost.memory import (
    decay_params_per_device,
    device_capacity,
    device_reserve,
    stage_memory,
    stage_params_per_device,
)
from flashflex_cli.cost.params import CostParams
from flashflex_cli.model import flops as F
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import TrainConfig
from flashflex_cli.semantics.runtime_paths import RuntimeOptions

from .cost_fixtures import cluster

MODEL = PRESETS["llama2-7b"]
TRAIN = TrainConfig(global_batch=16, seq_len=4096)
FUSED = dataclasses.replace(CostParams(), runtime=RuntimeOptions(optimizer="fused", chunked_loss=False, compile=False))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_states_are_fp32_parameters_gradients_and_two_moments_in_every_dtype(dtype: str) -> None:
    """The runtime keeps fp32 parameters (its master weights), fp32 gradients and AdamW's m and v: 16 bytes per
    parameter whatever the compute dtype; a 16-bit plan holds no separate low-precision weights."""
    mem = stage_memory(MODEL, TRAIN.model_copy(update={"dtype": dtype}), 1, 4, False, False, 1, FUSED, micro_batch_size=1)
    n = 4 * F.layer_params(MODEL)
    assert mem.optimizer == 8 * n
    buffers = 2 * 1 * 4097 * 8 + 2 * 4096 * MODEL.head_dim * 4  # the step's int64 tokens, the rotary tables
    assert mem.weights == 4 * n + buffers
    states = mem.weights + mem.optimizer + mem.grads
    assert mem.phase == "backward" and mem.grads == 4 * n  # the later backwards, every gradient allocated
    assert states + mem.activations + mem.transient == pytest.approx(mem.allocated)


@pytest.mark.parametrize("cast_once", [False, True], ids=["per-micro-batch", "cast-once"])
def test_in_flight_micro_batches_each_keep_their_saved_tensors(cast_once: bool) -> None:
    """Each micro-batch in flight adds its saved tensors and, cast per micro-batch, its own 16-bit copies of
    the layers' weights; cast once (RuntimeOptions.cast_once) the stage holds one set whatever the number."""
    params = dataclasses.replace(FUSED, runtime=dataclasses.replace(FUSED.runtime, cast_once=cast_once))
    one = stage_memory(MODEL, TRAIN, 1, 8, False, False, 1, params, num_micro=8, micro_batch_size=1)
    four = stage_memory(MODEL, TRAIN, 1, 8, False, False, 4, params, num_micro=8, micro_batch_size=1)
    p = A.PartShape(MODEL, 1, 1, 4096, "bf16", "sdpa", on_cuda=True, cast_once=cast_once)
    per_micro_batch = 8 * (A.layer_saved_bytes(p) + A.layer_weight_copies(p)) + p.tokens * p.h * A.FP32
    send_copy = p.tokens * p.h * 2  # each warm-up forward's bf16 send buffer, waited for at the step's end
    assert four.allocated - one.allocated == pytest.approx(3 * (per_micro_batch + send_copy))
    copies = 8 * F.layer_matmul_params(MODEL) * 2  # one bf16 set of the 8 layers' matrices
    assert A.layer_weight_copies(p) == (0.0 if cast_once else copies / 8)
    assert A.stage_weight_copies(p, 8) == (copies if cast_once else 0.0)
    assert four.weight_copies == pytest.approx(copies if cast_once else 4 * copies)


def test_tensor_parallelism_splits_the_sharded_tensors_not_the_replicated_ones() -> None:
    one = A.PartShape(MODEL, 1, 1, 4096, "bf16", "sdpa", on_cuda=True)
    two = A.PartShape(MODEL, 2, 1, 4096, "bf16", "sdpa", on_cuda=True)
    assert A.layer_saved_bytes(one) / 2 < A.layer_saved_bytes(two) < A.layer_saved_bytes(one)
    replicated = one.tokens * (4 * MODEL.hidden_size * 4 + 8 + 5 * MODEL.hidden_size * 2)  # fp32 stream, casts
    assert A.layer_saved_bytes(one) - A.layer_saved_bytes(two) == pytest.approx(
        (A.layer_saved_bytes(one) - replicated) / 2)


def test_recompute_keeps_each_layers_input_and_one_layer_again() -> None:
    recompute = TRAIN.model_copy(update={"recompute": True})
    plain = stage_memory(MODEL, TRAIN, 1, 16, False, False, 4, FUSED, num_micro=8, micro_batch_size=1)
    again = stage_memory(MODEL, recompute, 1, 16, False, False, 4, FUSED, num_micro=8, micro_batch_size=1)
    p = A.PartShape(MODEL, 1, 1, 4096, "bf16", "sdpa", on_cuda=True, cast_once=FUSED.runtime.cast_once)
    held = 4 * (16 * A.recompute_saved_bytes(p) + p.tokens * p.h * A.FP32) + 3 * p.tokens * p.h * 2
    held += A.stage_weight_copies(p, 16)  # cast once: the stage's one set of bf16 working weights
    assert again.activations == pytest.approx(held)
    assert again.allocated < plain.allocated - 3 * 15 * A.layer_saved_bytes(p)


def test_first_and_last_stages_hold_embedding_and_head_and_a_tied_table_once() -> None:
    tied = MODEL.model_copy(update={"tie_embeddings": True})
    table = F.embedding_params(MODEL)
    assert stage_params_per_device(MODEL, 2, 0, True, False)[1] == table / 2
    assert stage_params_per_device(MODEL, 2, 0, False, True)[1] == table / 2 + MODEL.hidden_size
    assert stage_params_per_device(MODEL, 1, 0, True, True)[1] == 2 * table + MODEL.hidden_size
    assert stage_params_per_device(tied, 1, 0, True, True)[1] == table + MODEL.hidden_size
    assert stage_params_per_device(tied, 1, 0, False, True)[1] == table + MODEL.hidden_size  # its own copy
    norms = 4 * 2 * MODEL.hidden_size + MODEL.hidden_size
    assert decay_params_per_device(MODEL, 1, 4, True, True) == sum(stage_params_per_device(MODEL, 1, 4, True, True)) - norms


def test_the_whole_vocabulary_loss_is_the_last_stages_peak_and_the_chunked_one_is_bounded() -> None:
    """The unchunked loss holds [tokens, vocab] fp32 tensors: they set the last stage's peak and grow with the
    micro-batch; the chunked loss holds one chunk of them."""
    model = PRESETS["llama-1b"]
    train = TrainConfig(global_batch=16, seq_len=2048)
    full = stage_memory(model, train, 1, 16, True, True, 1, FUSED, num_micro=2, micro_batch_size=8)
    chunked_params = dataclasses.replace(FUSED, runtime=RuntimeOptions(optimizer="fused", chunked_loss=True))
    chunked = stage_memory(model, train, 1, 16, True, True, 1, chunked_params, num_micro=2, micro_batch_size=8)
    logits_fp32 = 8 * 2048 * model.vocab_size * 4
    assert full.transient == pytest.approx(2 * logits_fp32)  # the loss's and the log-softmax's fp32 gradients
    assert full.allocated - chunked.allocated > 2 * logits_fp32


def test_the_multi_tensor_optimizer_needs_a_parameter_sized_temporary() -> None:
    """With few activations the optimizer step is the peak: the foreach path (CPU default, the recorded GPU
    runs) allocates one fp32 temporary as large as the parameters; the fused kernel none."""
    foreach = dataclasses.replace(FUSED, runtime=RuntimeOptions(optimizer="foreach", chunked_loss=False))
    train = TrainConfig(global_batch=16, seq_len=64)
    slow = stage_memory(MODEL, train, 1, 4, False, False, 1, foreach, micro_batch_size=1)
    fast = stage_memory(MODEL, train, 1, 4, False, False, 1, FUSED, micro_batch_size=1)
    assert slow.phase == "optimizer" and slow.transient == pytest.approx(4 * 4 * F.layer_params(MODEL))
    assert fast.phase != "optimizer" and fast.allocated < slow.allocated
    auto = dataclasses.replace(FUSED, runtime=RuntimeOptions(chunked_loss=False, compile=False))
    assert stage_memory(MODEL, train, 1, 4, False, False, 1, auto, on_cuda=True, micro_batch_size=1).allocated == fast.allocated
    assert stage_memory(MODEL, train, 1, 4, False, False, 1, auto, on_cuda=False, micro_batch_size=1).allocated == slow.allocated


def test_total_adds_the_allocators_slack_and_what_lives_outside_it() -> None:
    params = CostParams.from_overrides({"memory_fragmentation": 0.1, "memory_reserve_bytes": 2e9})
    mem = stage_memory(MODEL, TRAIN, 1, 2, False, False, 2, params, micro_batch_size=1)
    assert mem.fragmentation == pytest.approx(0.1 * mem.allocated)
    assert mem.total == pytest.approx(1.1 * mem.allocated + 2e9)
    assert stage_memory(MODEL, TRAIN, 1, 2, False, False, 2, params, reserve_bytes=123.0, micro_batch_size=1).reserve == 123.0


def test_llama2_7b_on_one_a100_does_not_fit_but_on_eight_stages_does() -> None:
    c = cluster(("A100-80G-SXM", 8, "ib", "nvlink"))
    params = CostParams()
    capacity = device_capacity(c, "node0/0", params)
    assert capacity == pytest.approx(80 * 1024**3 * (1 - params.memory_safety_margin))
    whole = stage_memory(MODEL, TRAIN, 1, 32, True, True, 1, params, micro_batch_size=1)
    assert whole.total > capacity  # 7B x 16 bytes = 108 GB of model states alone
    worst = max(stage_memory(MODEL, TRAIN, 1, 4, s == 0, s == 7, 8 - s, params, warmup=7 - s, micro_batch_size=1).total
                for s in range(8))
    assert worst < capacity


def test_cpu_devices_get_the_cpu_reserve() -> None:
    c = cluster(("cpu", 2, "eth", "shm"), ("T4", 1, "eth", "pcie"))
    params = CostParams()
    assert device_reserve(c, "node0/0", params) == params.cpu_memory_reserve_bytes
    assert device_reserve(c, "node1/0", params) == params.memory_reserve_bytes

"""The chunked loss (runtime/model/chunked_loss.py) against the unchunked one it replaces: logits, loss and every
gradient equal within fp32 / bf16 rounding, at TP 1 (one process) and TP 2 (gloo processes), fp32 and bf16
autocast, tied and untied embeddings, several chunks with a short last one; and its memory: the head's tracked
peak is what the module docstring says it holds, far below the unchunked head's.

Tolerances. fp32: the chunked loss sums the per-token losses chunk by chunk and accumulates the weight gradient
chunk by chunk (one fp32 matrix product per chunk instead of one over all tokens): `grad_atol` of
tests/test_parity.py (fp32 summation over the tokens) bounds the difference; the loss within 1e-5 relative.
bf16: both paths take the same bf16 matrix products per token row (logits, input gradients), but the weight
gradient's per-chunk products are each rounded to bf16 before their fp32 sum, where the unchunked path rounds
the one product over all tokens once: at most one bf16 half-ulp (2^-9 relative) per chunk and one more, of the
tensor's scale, so (chunks + 1) * 2^-9 * max|want| (a wrong chunk or a lost token is off by far more).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from flashflex_cli.model.spec import PRESETS, ModelSpec
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.model.init import full_init
from flashflex_cli.runtime.model.stage import StageModule
from flashflex_cli.runtime.model.tensor_parallel import TPContext
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine
from flashflex_cli.semantics.runtime_paths import LOSS_CHUNK_BYTES, RuntimeOptions, loss_chunk_tokens
from tests.infra.worker_pool import WorkerPool, gloo_rank
from tests.test_parity import grad_atol, make_plan

TINY = PRESETS["llama-tiny"]
TIED = TINY.model_copy(update={"name": "tiny-tied", "tie_embeddings": True})
CHUNK = 5  # tokens per chunk in these tests: 26 tokens -> 6 chunks, the last one of 1 token
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, total_steps=10, grad_clip=0.0)  # raw gradients
BF16_HALF_ULP = 2.0**-9


def _close(what: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = float((got.double() - want.double()).abs().max())
    assert err <= atol, f"{what}: max error {err:.3e} > {atol:.3e} (scale {float(want.abs().max()):.3e})"


def _atol(want: torch.Tensor, tokens: int, chunks: int, dtype: str) -> float:
    if dtype == "bf16":
        return (chunks + 1) * BF16_HALF_ULP * float(want.abs().max())
    return grad_atol(want, tokens)


def _whole_model(spec: ModelSpec, chunked: bool) -> StageModule:
    module = StageModule(spec, (0, spec.num_layers), True, True, TPContext(group=None), chunked_loss=chunked)
    with torch.no_grad():
        for info, param in module.global_parameters():
            param.copy_(full_init(spec, info.name, info.shape, seed=3))
    module.loss_chunk_tokens = CHUNK
    return module


def _one_process(spec: ModelSpec, chunked: bool, dtype: str, tokens: torch.Tensor) -> dict[str, Any]:
    module = _whole_model(spec, chunked)
    module.capture_logits = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = module(tokens[:, :-1], tokens[:, 1:])
    (loss * 0.25).backward()
    return {"loss": float(loss.detach()), "logits": module.capture_logits[0],
            "grads": {info.name: param.grad for info, param in module.global_parameters()}}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", [TINY, TIED], ids=["untied", "tied"])
def test_one_process_chunked_equals_unchunked(spec: ModelSpec, dtype: str) -> None:
    tokens = torch.randint(0, spec.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    n = tokens[:, 1:].numel()
    chunks = -(-n // CHUNK)
    want, got = _one_process(spec, False, dtype, tokens), _one_process(spec, True, dtype, tokens)
    assert chunks == 6 and n % CHUNK == 1  # several chunks, a short last one
    assert got["logits"].dtype == want["logits"].dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    _close("logits", got["logits"].float(), want["logits"].float(), _atol(want["logits"].float(), 64, 0, dtype))
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert set(got["grads"]) == set(want["grads"]) and "embed" in got["grads"]
    for name, grad in want["grads"].items():
        _close(f"grad {name}", got["grads"][name], grad, _atol(grad, n, chunks, dtype))


def test_chunk_size_follows_the_byte_budget() -> None:
    """One chunk's fp32 logits [tokens, vocab / tp] stay within LOSS_CHUNK_BYTES, and use most of it."""
    for vocab in (256, 32000, 128256, 128256 // 4, 151936, 10**9):
        tokens = loss_chunk_tokens(vocab)
        assert tokens >= 1
        assert tokens * vocab * 4 <= LOSS_CHUNK_BYTES or tokens == 1
        assert (tokens + 1) * vocab * 4 > LOSS_CHUNK_BYTES
    assert StageModule(TINY, (0, 0), False, True, TPContext(group=None)).loss_chunk_tokens == loss_chunk_tokens(256)


# ------------------------------------------------------------------------------------------------ memory


def _head_peak(chunked: bool, dtype: torch.dtype, chunk: int) -> tuple[int, int]:
    """(peak bytes tracked by torch's MemTracker over the head's forward and backward, bytes held before it:
    parameters and inputs) of a last stage with no layers (final norm, projection, loss)."""
    spec = TINY.model_copy(update={"vocab_size": VOCAB})
    module = StageModule(spec, (0, 0), False, True, TPContext(group=None), chunked_loss=chunked)
    for param in module.parameters():
        torch.nn.init.normal_(param, std=0.02)
    module.loss_chunk_tokens = chunk
    x = torch.randn(B, S, spec.hidden_size, requires_grad=True)
    targets = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(0))
    tracker = MemTracker()
    tracker.track_external(module, x, targets)
    with tracker:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = module(x, targets)
        loss.backward()
    peak = int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    held = sum(p.numel() * p.element_size() for p in module.parameters()) + x.numel() * 4 + targets.numel() * 8
    return peak, held


B, S, VOCAB, H = 4, 256, 8192, TINY.hidden_size  # 1024 tokens: unchunked fp32 logits 32 MiB, a chunk of 128: 4 MiB


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_head_peak_is_what_the_docstring_says_and_far_below_unchunked(dtype: torch.dtype) -> None:
    """The chunked head's tracked peak equals the module docstring's account within 3%: the final norm's
    saved tensors and output ([N, H] fp32 each), grad_h [N, H] fp32, grad_w [V, H] fp32, the weight in the
    compute dtype [V, H] (none in fp32) and one chunk's peak: two fp32 [n, V] while the sums are taken.
    The unchunked head holds the whole [N, V] logits (compute dtype and fp32) and more: over 5x here."""
    n_tok, chunk = B * S, 128
    c = 2 if dtype == torch.bfloat16 else 4
    peak, held = _head_peak(True, dtype, chunk)
    norm = 2 * n_tok * H * 4 + n_tok * 4  # x * rsqrt (saved), the output h, the rsqrt [N, 1]
    grads = n_tok * H * 4 + VOCAB * H * 4
    weight_copy = VOCAB * H * c if c != 4 else 0
    chunk_peak = 2 * chunk * VOCAB * 4 + chunk * H * c
    account = held + norm + grads + weight_copy + chunk_peak
    assert abs(peak - account) <= 0.03 * account, (peak, account)
    unchunked, _ = _head_peak(False, dtype, chunk)
    assert unchunked > 5 * peak
    # the chunk's share grows with the chunk: 4x the chunk, 4x its [n, V] terms (the rest unchanged)
    bigger, _ = _head_peak(True, dtype, 4 * chunk)
    assert abs((bigger - peak) - 3 * (2 * chunk * VOCAB * 4 + chunk * H * c)) <= 0.03 * account


# ------------------------------------------------------------------------------------------- TP 2 (gloo)


def _tp_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, chunked: bool) -> None:
    """One rank of a one-stage TP plan: shared weights, one step's gradients, the logit shards and the loss."""
    with gloo_rank(rank, world, init_file, deterministic=False):
        plan = Plan.model_validate_json(plan_json)
        engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OPTIM,
                            options=RuntimeOptions(chunked_loss=chunked))
        engine.module.loss_chunk_tokens = CHUNK
        engine.module.capture_logits = []
        spec, train = plan.inputs.model, plan.inputs.train
        tokens = torch.randint(0, spec.vocab_size, (train.global_batch, train.seq_len + 1),
                               generator=torch.Generator().manual_seed(4))
        result = engine.train_step(tokens)
        torch.save({"loss": result.loss, "grads": engine.gather_full_grads(), "vocab_start": engine.module.vocab_start,
                    "logits": engine.module.capture_logits}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(2, _tp_job) as workers:
        yield workers


def _run(plan: Plan, chunked: bool, tmp_path: Path, pool: WorkerPool) -> list[dict[str, Any]]:
    out = tmp_path / f"run-{chunked}"
    out.mkdir()
    pool.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out), chunked)
              for rank in range(plan.world_size)])
    return [torch.load(out / f"rank{r}.pt") for r in range(plan.world_size)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", [TINY, TIED], ids=["untied", "tied"])
def test_tp2_chunked_equals_unchunked(spec: ModelSpec, dtype: str, tmp_path: Path, pool: WorkerPool) -> None:
    """Vocabulary-parallel at TP 2 (each rank 128 of the 256 rows): the per-chunk all-reduces give the same
    loss, logit shards and gradients as the unchunked vocabulary-parallel loss."""
    plan = make_plan(spec, [(2, 1, [(2, (0, 4))])], seq_len=13)
    plan = plan.model_copy(update={"inputs": plan.inputs.model_copy(update={
        "train": plan.inputs.train.model_copy(update={"dtype": dtype})})})
    n = plan.inputs.train.tokens_per_step
    chunks = -(-n // CHUNK)
    want, got = _run(plan, False, tmp_path, pool), _run(plan, True, tmp_path, pool)
    for rank in range(2):
        assert got[rank]["vocab_start"] == want[rank]["vocab_start"] == 128 * rank
        assert got[rank]["loss"] == pytest.approx(want[rank]["loss"], rel=1e-5)
        (logits,), (ref,) = got[rank]["logits"], want[rank]["logits"]
        assert logits.shape == ref.shape == (2, 13, 128)
        _close(f"rank {rank} logits", logits.float(), ref.float(), _atol(ref.float(), 64, 0, dtype))
        assert set(got[rank]["grads"]) == set(want[rank]["grads"])
        for name, grad in want[rank]["grads"].items():
            _close(f"rank {rank} grad {name}", got[rank]["grads"][name], grad, _atol(grad, n, chunks, dtype))

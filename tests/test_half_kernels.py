"""tests/infra/half_kernels.py, which the tensor-accounted memory tests run their 16-bit plans under, changes no
tensor the accounting counts: a rank's tracked peak of every step is the same to the byte with and without it, on
bf16 and fp16, SDPA (with a sliding window's mask) and eager attention, with and without recompute; and its losses
are the native kernels' within 16-bit rounding."""

from __future__ import annotations

import contextlib

import pytest
import torch

from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.semantics.runtime_paths import RuntimeOptions
from tests.infra.half_kernels import HalfKernelsInFloat32
from tests.infra.tensor_accounting import TensorAccounting
from tests.test_memory_tracked import OPTIM, _plan

TINY = PRESETS["llama-tiny"]  # h 64, 4 layers, vocab 256
TINY_WINDOW = TINY.model_copy(update={"family": "mistral", "sliding_window": 8})
STEPS = 3
# Relative difference of a step's loss: the fp32 products round once where the 16-bit kernels may round their
# partial sums in another order; a loss near ln(256) = 5.5 moves by a few units of the 16-bit roundoff
# (bf16 2^-8, fp16 2^-11) through 4 layers.
LOSS_RTOL = {"bf16": 8 * 2.0**-8, "fp16": 8 * 2.0**-11}


def _steps(plan: Plan, wide: bool) -> tuple[list[int], list[float], int]:
    """Each step's tracked peak (bytes) and loss of `plan` on one rank, under the fp32 kernels when `wide`; and how
    many operations those computed."""
    torch.manual_seed(0)
    tokens = torch.randint(0, TINY.vocab_size, (plan.inputs.train.global_batch, plan.inputs.train.seq_len + 1))
    mode = HalfKernelsInFloat32()
    peaks, losses = [], []
    with mode if wide else contextlib.nullcontext(), TensorAccounting() as accounting:
        engine = RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), OPTIM, seed=3,
                            options=RuntimeOptions())
        for _ in range(STEPS):
            accounting.reset_peak()
            losses.append(engine.train_step(tokens.clone()).loss)
            peaks.append(accounting.peak_bytes)
    return peaks, losses, mode.handled


@pytest.mark.parametrize("dtype, attention, recompute, model", [
    ("bf16", "sdpa", False, TINY), ("fp16", "eager", True, TINY), ("bf16", "sdpa", True, TINY_WINDOW),
    ("fp16", "sdpa", False, TINY_WINDOW)], ids=["bf16-sdpa", "fp16-eager-recompute", "bf16-window-recompute",
                                                 "fp16-window"])
def test_the_tracked_peaks_are_the_native_kernels_to_the_byte(world_of_one: None, dtype: str, attention: str,
                                                               recompute: bool, model: object) -> None:
    plan = _plan(model, [(2, 2, [(1, (0, 4))])], seq=32, dtype=dtype, attention=attention,  # type: ignore[arg-type]
                 recompute=recompute)
    native_peaks, native_losses, _ = _steps(plan, wide=False)
    wide_peaks, wide_losses, handled = _steps(plan, wide=True)
    assert handled > 0  # the products (and SDPA) went through the mode
    assert wide_peaks == native_peaks
    assert wide_losses == pytest.approx(native_losses, rel=LOSS_RTOL[dtype])

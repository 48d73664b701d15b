"""torch's fused linear cross-entropy as the head's loss (RuntimeOptions.loss_kernel "torch",
runtime/model/torch_loss.py) against the unchunked loss: the loss and every gradient equal within the tolerances
of tests/test_chunked_loss.py (fp32: the summation over tokens; bf16: one half-ulp per chunk of the weight
gradient's per-chunk products, and the same bound for the loss, which torch sums in bf16 chunk by chunk), tied and untied; a TP-2 stage keeps the project's loss. Also the project's own chunked loss with the
mixed-dtype product helper (`product_into`) on CPU, where it takes the compute-dtype product."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flashflex_cli.model.spec import ModelSpec
from flashflex_cli.runtime.model import torch_loss
from flashflex_cli.runtime.model.chunked_loss import product_into
from flashflex_cli.runtime.model.stage import StageModule
from flashflex_cli.runtime.model.tensor_parallel import TPContext
from flashflex_cli.semantics.runtime_paths import LEGACY, RuntimeOptions, from_record
from tests.test_chunked_loss import CHUNK, TIED, TINY, _atol, _close, _whole_model

pytestmark = pytest.mark.skipif(not torch_loss.available(), reason="this torch has no linear_cross_entropy")


def _run(spec: ModelSpec, torch_kernel: bool, chunked: bool, dtype: str, tokens: torch.Tensor) -> dict[str, Any]:
    module = _whole_model(spec, chunked)
    module.torch_loss = torch_kernel
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = module(tokens[:, :-1], tokens[:, 1:])
    (loss * 0.25).backward()
    return {"loss": float(loss.detach()), "dtype": loss.dtype,
            "grads": {info.name: param.grad for info, param in module.global_parameters()}}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("spec", [TINY, TIED], ids=["untied", "tied"])
def test_torch_kernel_equals_unchunked(spec: ModelSpec, dtype: str) -> None:
    tokens = torch.randint(0, spec.vocab_size, (2, 14), generator=torch.Generator().manual_seed(1))
    n = tokens[:, 1:].numel()
    chunks = -(-n // CHUNK)
    want, got = _run(spec, False, False, dtype, tokens), _run(spec, True, True, dtype, tokens)
    assert got["dtype"] == torch.float32
    # bf16: torch sums the loss in bf16, chunk by chunk, each sum rounded: one half-ulp per chunk and one more
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5 if dtype == "fp32" else (chunks + 1) * 2.0**-9)
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        _close(f"grad {name}", got["grads"][name], grad, _atol(grad, n, chunks, dtype))


def test_the_switch_reaches_tp1_stages_only_and_records() -> None:
    """loss_kernel "torch" takes torch's op on a TP-1 stage; the record says so; older records read "own"."""
    one = StageModule(TINY, (0, 1), True, True, TPContext(group=None), chunked_loss=True, loss_kernel="torch")
    two = StageModule(TINY, (0, 1), True, True, TPContext(group=None, size=2), chunked_loss=True,
                      loss_kernel="torch")
    assert one.torch_loss and not two.torch_loss
    assert not StageModule(TINY, (0, 1), True, True, TPContext(group=None), chunked_loss=True).torch_loss
    record = RuntimeOptions(loss_kernel="torch").resolved(False).to_record("bf16")
    assert from_record(record, "bf16", False).options.loss_kernel == "torch"
    assert LEGACY["loss_kernel"] == "own" and from_record({}, "bf16", True).options.loss_kernel == "own"
    with pytest.raises(ValueError, match="loss_kernel"):
        RuntimeOptions(loss_kernel="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("accumulate", [False, True])
def test_product_into_mixed_dtypes_on_cpu(accumulate: bool) -> None:
    """bf16 operands into an fp32 sum: what the fp32 product of the bf16 values gives, within one bf16 rounding
    of the product (CPU takes the compute-dtype product, then adds it)."""
    generator = torch.Generator().manual_seed(2)
    left, right = (torch.randn(shape, generator=generator).bfloat16() for shape in ((6, 40), (40, 9)))
    out = torch.randn(6, 9, generator=generator)
    want = (out if accumulate else torch.zeros_like(out)) + left.float() @ right.float()
    product_into(out, left, right, accumulate)
    _close("product", out, want, 2.0**-8 * float((left.float() @ right.float()).abs().max()))

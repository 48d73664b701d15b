"""cost/activations.py counts, part by part, what the runtime's own modules keep and allocate: each part (a decoder
layer, the embedding, the head with its loss) runs forward and backward in one process under PyTorch's tensor
accounting, and its saved bytes, the forward's temporaries above them and the backward's (with and without
gradients already allocated) equal the counts to within a few bytes per token (the per-token loss scalars the
counts leave out). Shapes differ in every width so that a term counted with the wrong width shows."""

from __future__ import annotations

import pytest
import torch

from flashflex_cli.cost import activations as A
from flashflex_cli.model.spec import ModelSpec
from flashflex_cli.runtime.model.precision import autocast
from flashflex_cli.runtime.model.stage import StageModule
from flashflex_cli.runtime.model.tensor_parallel import TPContext
from tests.infra.tensor_accounting import TensorAccounting

SHAPES = {  # hidden, MLP, heads, kv heads, vocab, micro-batch, sequence
    "gqa": ModelSpec(name="a", hidden_size=128, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=512,
                     vocab_size=1000),
    "mha-wide-mlp": ModelSpec(name="b", hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
                              intermediate_size=1024, vocab_size=700),
}
RUNS = {"gqa": (2, 64), "mha-wide-mlp": (8, 32)}
LAYOUTS = {"layer": ((0, 1), False, False), "embedding": ((0, 0), True, False), "head": ((0, 0), False, True)}
BACKEND = {"sdpa": "sdpa", "eager": "eager"}


def _measure(spec: ModelSpec, part: str, b: int, s: int, dtype: str, attention: str,
             recompute: bool, chunk: int | None = None) -> list[dict[str, int]]:
    """Two rounds of forward + backward of one part (round 0 without gradients, round 1 accumulating):
    bytes kept after the forward, the forward's peak and the backward's peak above what was there before each."""
    layers, first, last = LAYOUTS[part]
    rounds = []
    with TensorAccounting() as acc:
        module = StageModule(spec, layers, first, last, TPContext(None), BACKEND[attention], recompute=recompute,
                             chunked_loss=chunk is not None)
        if chunk is not None:
            module.loss_chunk_tokens = chunk  # several chunks at these small shapes
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, 0.02, generator=generator)
        x = torch.randn(b, s, spec.hidden_size, generator=generator, requires_grad=True)
        tokens = torch.randint(0, spec.vocab_size, (b, s + 1), generator=generator)
        module._tables(s, x.device)
        for _ in range(2):
            acc.reset_peak()
            base = acc.live_bytes()
            with autocast(torch.device("cpu"), dtype):
                out = module(x) if part == "layer" else module(tokens[:, :-1]) if part == "embedding" else \
                    module(x, tokens[:, 1:])
            after, forward_peak = acc.live_bytes(), acc.peak_bytes
            grad = torch.ones_like(out)
            acc.reset_peak()
            out.backward(grad)
            rounds.append({"saved": after - base, "forward": forward_peak - after,
                           "backward": acc.peak_bytes - after - grad.numel() * grad.element_size()})
            del out, grad
            x.grad = None
    return rounds


def _counted(p: A.PartShape, part: str, recompute: bool) -> list[dict[str, float]]:  # noqa: C901
    """The same figures from cost/activations.py (the part's input, created before, left out of "saved")."""
    incoming = p.tokens * p.h * A.FP32  # the backward's incoming gradient: measured outside the figure
    if part == "layer":
        if recompute:
            saved = 0.0  # only the input, which existed before
            again = A.layer_saved_bytes(p) + A.layer_weight_copies(p) - A.recompute_saved_bytes(p)
        else:
            saved, again = A.layer_saved_bytes(p) + A.layer_weight_copies(p) - A.recompute_saved_bytes(p), 0.0
        saved += p.tokens * p.h * A.FP32  # its output
        return [{"saved": saved, "backward": again + A.layer_backward_transient_bytes(p, accumulating=bool(r))
                 - incoming, "forward": None if recompute else A.layer_forward_transient_bytes(p)} for r in (0, 1)]
    if part == "embedding":
        saved = A.embedding_saved_bytes(p) + p.tokens * p.h * A.FP32
        return [{"saved": saved, "forward": 0.0,
                 "backward": A.embedding_backward_transient_bytes(p) - incoming}] * 2
    saved = A.head_saved_bytes(p) + A.head_weight_copies(p) - p.tokens * p.h * A.FP32
    return [{"saved": saved, "forward": A.head_forward_transient_bytes(p),
             "backward": A.head_backward_transient_bytes(p, accumulating=bool(r))} for r in (0, 1)]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("part,attention,recompute,chunk", [
    ("layer", "sdpa", False, None), ("layer", "eager", False, None), ("layer", "sdpa", True, None),
    ("embedding", "sdpa", False, None), ("head", "sdpa", False, None), ("head", "sdpa", False, 48)])
def test_each_part_holds_what_the_cost_model_counts(shape: str, dtype: str, part: str, attention: str,
                                                    recompute: bool, chunk: int | None) -> None:
    spec = SHAPES[shape]
    b, s = RUNS[shape]
    p = A.PartShape(spec, 1, b, s, dtype, attention, on_cuda=False, chunked_loss=chunk is not None,
                    loss_chunk=chunk)
    slack = 12 * p.tokens + 64  # per-token losses, targets' copies and reductions the counts leave out
    for round_, (got, want) in enumerate(zip(_measure(spec, part, b, s, dtype, attention, recompute, chunk),
                                             _counted(p, part, recompute), strict=True)):
        for key, value in want.items():
            if value is None:  # a checkpointed layer's forward keeps nothing: its temporaries are not a term
                continue
            assert abs(got[key] - value) <= slack, f"round {round_} {key}: measured {got[key]}, counted {value:.0f}"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_compiled_layer_keeps_what_the_cost_model_counts(dtype: str) -> None:
    """torch.compile (inductor, as on GPUs) keeps another set of tensors than eager: read off the saved-tensor
    hooks of the compiled layer's graph (the tensor accounting's dispatch mode would run it eager), new storages
    only (parameters, input and rotary tables excluded)."""
    from flashflex_cli.runtime.model.compiled import compile_stage

    spec = SHAPES["gqa"]
    b, s = 3, 50  # N differs from every width
    module = StageModule(spec, (0, 1), False, False, TPContext(None))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02, generator=generator)
    compile_stage(module)
    x = torch.randn(b, s, spec.hidden_size, generator=generator, requires_grad=True)
    known = {t.untyped_storage().data_ptr() for t in (*module.parameters(), x, *module._tables(s, x.device))}
    for _ in range(2):  # the first call compiles
        found: dict[int, int] = {}

        def pack(t: torch.Tensor, found: dict[int, int] = found) -> torch.Tensor:
            found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(torch.device("cpu"), dtype):
            out = module(x)
        out.sum().backward()
    kept = sum(n for ptr, n in found.items() if ptr not in known)
    p = A.PartShape(spec, 1, b, s, dtype, "sdpa", on_cuda=False, compiled=True)
    assert A.compiled_layer(p)
    counted = A.layer_saved_bytes(p) + A.layer_weight_copies(p) - A.recompute_saved_bytes(p)  # input: known
    assert kept == counted

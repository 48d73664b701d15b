"""Single-process checks of the runtime's model pieces: init, sharding, rotary, attention, the stage module."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from flashflex_cli.model.spec import PRESETS
from flashflex_cli.runtime.model.attention import FLASH, SDPA, attention_fn, choose_backend
from flashflex_cli.runtime.model.init import INIT_STD, full_init, param_seed
from flashflex_cli.runtime.model.stage import apply_rotary, rotary_tables
from flashflex_cli.runtime.training.reference import build_reference
from flashflex_cli.semantics.parameters import layer_params, model_params, shard_bounds

TINY = PRESETS["llama-tiny"]
GQA = PRESETS["llama-tiny-gqa"]


def test_init_depends_on_seed_and_name_only() -> None:
    a = full_init(TINY, "layers.1.attn.wq", (64, 64), seed=3)
    assert torch.equal(a, full_init(TINY, "layers.1.attn.wq", (64, 64), seed=3))
    assert not torch.equal(a, full_init(TINY, "layers.1.attn.wq", (64, 64), seed=4))
    assert not torch.equal(a, full_init(TINY, "layers.2.attn.wq", (64, 64), seed=3))
    assert param_seed(0, "embed") != param_seed(0, "head")
    assert abs(float(a.std()) - INIT_STD) < 0.002
    wo = full_init(TINY, "layers.1.attn.wo", (64, 64), seed=3)
    assert abs(float(wo.std()) - INIT_STD / math.sqrt(2 * TINY.num_layers)) < 0.001
    assert torch.equal(full_init(TINY, "layers.0.mlp_norm", (64,), seed=3), torch.ones(64))


@pytest.mark.parametrize("n", [64, 176, 256, 250])
def test_tp2_shard_is_union_of_two_tp4_shards(n: int) -> None:
    for t in range(2):
        start2, stop2 = shard_bounds(n, 2, t)
        assert (start2, shard_bounds(n, 4, 2 * t)[1]) == (start2, shard_bounds(n, 4, 2 * t + 1)[0])
        assert (shard_bounds(n, 4, 2 * t)[0], shard_bounds(n, 4, 2 * t + 1)[1]) == (start2, stop2)
    assert shard_bounds(n, 4, 0)[0] == 0 and shard_bounds(n, 4, 3)[1] == n


def test_param_shards_follow_heads_and_matching_halves() -> None:
    infos = {info.name: info for info in layer_params(GQA, 0)}
    hd = GQA.head_dim
    assert infos["layers.0.attn.wq"].bounds(2, 1) == (2 * hd, 4 * hd)  # query heads 2 and 3
    assert infos["layers.0.attn.wk"].bounds(2, 1) == (hd, 2 * hd)  # kv head 1, the group of q heads 2, 3
    assert infos["layers.0.mlp.w_gate"].bounds(2, 0) == infos["layers.0.mlp.w_up"].bounds(2, 0) == (0, 88)
    assert infos["layers.0.attn.wo"].shard_dim == 1 and infos["layers.0.mlp.w_down"].shard_dim == 1
    assert infos["layers.0.attn_norm"].shard_dim is None
    full = torch.arange(64 * 176, dtype=torch.float32).view(176, 64)
    gate = infos["layers.0.mlp.w_gate"]
    union = torch.cat([gate.take(full, 4, 2), gate.take(full, 4, 3)])
    assert torch.equal(union, gate.take(full, 2, 1))
    names = [info.name for info in model_params(TINY)]
    assert names[0] == "embed" and names[-2:] == ["norm", "head"] and len(names) == 3 + 9 * TINY.num_layers


def test_rotary_depends_on_relative_position_only() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 16, generator=gen)
    k = torch.randn(1, 1, 1, 16, generator=gen)
    cos, sin = rotary_tables(32, 16, 10000.0, torch.device("cpu"))

    def score(m: int, n: int) -> float:
        qm = apply_rotary(q, cos[m:m + 1], sin[m:m + 1])
        kn = apply_rotary(k, cos[n:n + 1], sin[n:n + 1])
        return float((qm * kn).sum())

    assert score(5, 2) == pytest.approx(score(20, 17), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)
    assert apply_rotary(q, cos[:1], sin[:1]).equal(q)  # position 0 is the identity


def test_sdpa_gqa_matches_manual_attention() -> None:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 4, 8, generator=gen)
    k = torch.randn(2, 6, 2, 8, generator=gen)
    v = torch.randn(2, 6, 2, 8, generator=gen)
    out = attention_fn(SDPA)(q, k, v)
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)  # q heads 0,1 -> kv 0; 2,3 -> kv 1
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv)
    assert torch.allclose(out, want, atol=1e-5)


def test_backend_is_sdpa_on_cpu_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="flashflex.runtime"):
        assert choose_backend(torch.device("cpu"), torch.bfloat16, rank=3) == SDPA
        assert choose_backend(torch.device("cpu"), torch.float32, prefer=FLASH) == SDPA
    assert "rank 3: attention backend sdpa (device cpu is not CUDA)" in caplog.text


def test_model_is_causal_and_starts_near_uniform_loss() -> None:
    model = build_reference(TINY, seed=0)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, TINY.vocab_size, (2, 13), generator=gen)
    with torch.no_grad():
        loss = model(tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
    assert abs(float(loss) - math.log(TINY.vocab_size)) < 0.1
    # Changing the last input token changes no earlier hidden state.
    changed = tokens.clone()
    changed[:, -2] = (changed[:, -2] + 1) % TINY.vocab_size
    model.last = False
    with torch.no_grad():
        a, b = model(tokens[:, :-1]), model(changed[:, :-1])
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])


def test_reference_layer_matches_plain_torch_llama_math() -> None:
    """One decoder layer written out with plain torch ops equals the stage module's layer."""
    model = build_reference(GQA, seed=5)
    layer = model.layers[0]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, GQA.hidden_size, generator=gen)
    cos, sin = rotary_tables(7, GQA.head_dim, GQA.rope_theta, torch.device("cpu"))
    with torch.no_grad():
        got = layer(x, cos, sin)

        def norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + GQA.norm_eps) * w

        def rope(t: torch.Tensor) -> torch.Tensor:
            t1, t2 = t[..., : GQA.head_dim // 2], t[..., GQA.head_dim // 2:]
            return t * cos + torch.cat([-t2, t1], -1) * sin

        a = layer.attn
        h = norm(x, layer.attn_norm.weight)
        q = rope((h @ a.wq.T).view(2, 7, 4, 16)).transpose(1, 2)
        k = rope((h @ a.wk.T).view(2, 7, 2, 16)).transpose(1, 2).repeat_interleave(2, 1)
        v = (h @ a.wv.T).view(2, 7, 2, 16).transpose(1, 2).repeat_interleave(2, 1)
        att = (q @ k.transpose(-1, -2) / 4.0).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -1e30)
        y = x + ((att.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 64) @ a.wo.T)
        m = layer.mlp
        g = norm(y, layer.mlp_norm.weight)
        want = y + (F.silu(g @ m.w_gate.T) * (g @ m.w_up.T)) @ m.w_down.T
    assert torch.allclose(got, want, atol=1e-5)


def test_recompute_reruns_layer_forward_in_backward() -> None:
    from flashflex_cli.runtime.model.stage import StageModule
    from flashflex_cli.runtime.model.tensor_parallel import TPContext

    calls = {"n": 0}
    tokens = torch.randint(0, TINY.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    for recompute, want in ((False, 1), (True, 2)):
        module = StageModule(TINY, (0, 2), True, True, TPContext(group=None), recompute=recompute)
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
        calls["n"] = 0
        module.layers[0].register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
        module(tokens[:, :-1], tokens[:, 1:]).backward()
        assert calls["n"] == want

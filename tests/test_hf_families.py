"""Model families from Hugging Face configs (Llama 2/3/3.1, Mistral, Qwen2, tied embeddings): what is read,
what is refused, what the cost model counts, and the runtime pieces (window, llama3 rotary, biases, tied
embeddings) checked in one process. Numerical equivalence with `transformers`: tests/test_hf_equivalence.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from flashflex_cli.cli import main
from flashflex_cli.cost.dp import dp_reduction
from flashflex_cli.cost.params import CostParams
from flashflex_cli.errors import InputError
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model import flops as F
from flashflex_cli.model.hf_config import from_hf_config, spec_from_hf_dict, to_hf_config
from flashflex_cli.model.spec import PRESETS, ModelSpec, RopeScaling
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.model.attention import EAGER, SDPA, attention_fn, band_mask
from flashflex_cli.runtime.model.stage import StageModule, llama3_inv_freq
from flashflex_cli.runtime.model.tensor_parallel import TPContext
from flashflex_cli.runtime.parallel.groups import slice_holders
from flashflex_cli.runtime.training.engine import plan_shard_specs
from flashflex_cli.semantics.parameters import model_params, stage_params
from tests.test_parity import make_plan

GOLDEN = Path(__file__).parent / "golden"
BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 176, "vocab_size": 256}


def _read(tmp_path: Path, **keys: Any) -> ModelSpec:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**BASE, **keys}))
    return from_hf_config(path)


# ---- reading ----------------------------------------------------------------------------------
def test_rope_theta_is_read_where_each_transformers_version_puts_it(tmp_path: Path) -> None:
    assert _read(tmp_path, rope_theta=5e5).rope_theta == 5e5  # 4.x: top level
    saved_by_5x = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert _read(tmp_path, **saved_by_5x).rope_theta == 5e5
    assert _read(tmp_path).rope_theta == 10000.0  # the reference's default_theta


def test_llama31_rope_scaling_is_read_from_either_key(tmp_path: Path) -> None:
    want = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    legacy = {"rope_theta": 5e5, "max_position_embeddings": 131072,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    current = {"max_position_embeddings": 131072,
               "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    for keys in (legacy, current):
        spec = _read(tmp_path, **keys)
        assert spec.rope_scaling == want and spec.rope_theta == 5e5 and spec.family == "llama"
    # without original_max_position_embeddings the reference falls back to max_position_embeddings
    del current["rope_parameters"]["original_max_position_embeddings"]
    assert _read(tmp_path, **current).rope_scaling.original_max_position_embeddings == 131072


def test_reference_defaults_for_absent_keys(tmp_path: Path) -> None:
    llama = _read(tmp_path)
    assert llama.norm_eps == 1e-6 and not llama.tie_embeddings and llama.sliding_window is None
    mistral = _read(tmp_path, model_type="mistral", num_attention_heads=8, num_key_value_heads=None)
    assert mistral.num_kv_heads == 8  # explicit null: the heads count, as __post_init__ does
    bare = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    path = tmp_path / "m.json"
    path.write_text(json.dumps({**bare, "num_attention_heads": 16, "model_type": "mistral"}))
    absent = from_hf_config(path)
    assert absent.num_kv_heads == 8 and absent.sliding_window == 4096  # MistralConfig's class defaults
    path.write_text(json.dumps({**bare, "num_attention_heads": 32, "model_type": "qwen2"}))
    assert from_hf_config(path).num_kv_heads == 32  # Qwen2Config's class default


def test_explicit_head_dim_is_used(tmp_path: Path) -> None:
    spec = _read(tmp_path, head_dim=32)
    assert spec.head_dim == 32 and spec.head_dim_override == 32
    assert F.q_width(spec) == 128 and F.kv_width(spec) == 64
    assert F.layer_matmul_params(spec) == 2 * 64 * 128 + 2 * 64 * 64 + 3 * 64 * 176
    same = _read(tmp_path, head_dim=16)  # equal to hidden / heads: nothing to record
    assert same.head_dim_override is None and "head_dim_override" not in same.model_dump()


def test_families(tmp_path: Path) -> None:
    mistral = _read(tmp_path, model_type="mistral", sliding_window=8)
    assert (mistral.family, mistral.sliding_window, mistral.attention_bias) == ("mistral", 8, False)
    assert _read(tmp_path, model_type="mistral", sliding_window=None).sliding_window is None
    qwen = _read(tmp_path, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True)
    assert (qwen.family, qwen.attention_bias, qwen.tie_embeddings, qwen.sliding_window) == ("qwen2", True, True, None)
    every_layer = _read(tmp_path, model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert every_layer.sliding_window == 8
    no_layer = _read(tmp_path, model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert no_layer.sliding_window is None
    assert _read(tmp_path, model_type="llama", sliding_window=8).sliding_window is None  # LlamaConfig ignores it


@pytest.mark.parametrize("keys, named", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"mlp_bias": True}, "mlp_bias True"),
    ({"attention_bias": True}, "attention_bias True"),
    ({"attention_dropout": 0.1}, "attention_dropout 0.1"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type 'yarn'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type 'dynamic'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor, high_freq_factor"),
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"architectures": ["GemmaForCausalLM"]}, "architectures ['GemmaForCausalLM']"),
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1}, "max_window_layers 1"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e6}}},
     "rope_parameters"),
    ({"num_key_value_heads": 3}, "num_kv_heads 3"),
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": "x"}, "max_window_layers 'x'"),
    ({"architectures": [{"a": 1}]}, "architectures [{'a': 1}]"),
    ({"rope_scaling": [1]}, "rope_scaling [1]"),
    ({"rms_norm_eps": None}, "rms_norm_eps"),
])
def test_unhonoured_keys_are_refused_by_name(tmp_path: Path, keys: dict[str, Any], named: str) -> None:
    with pytest.raises(InputError, match="config.json: ") as info:
        _read(tmp_path, **keys)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_cli_refuses_in_one_line_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BASE, "hidden_act": "gelu_new"}))
    (tmp_path / "cluster.json").write_text((GOLDEN / "cluster-2node.json").read_text())
    out = tmp_path / "plan.json"
    code = main(["plan", str(tmp_path / "cluster.json"), "-m", str(config), "-b", "8", "-s", "32", "--strategy",
                 "uniform", "--no-baseline", "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "hidden_act 'gelu_new'" in err and len(err.splitlines()) == 1 and not out.exists()


def test_old_plans_keep_their_meaning_and_bytes() -> None:
    old = PRESETS["llama-tiny"].model_dump()
    assert set(old) == {"name", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                        "vocab_size", "rope_theta", "norm_eps", "tie_embeddings"}
    spec = ModelSpec.model_validate(old)
    assert (spec.family, spec.attention_bias, spec.sliding_window, spec.rope_scaling) == ("llama", False, None, None)
    committed = json.loads((GOLDEN / "plan-4rank.json").read_text())["inputs"]["model"]
    assert ModelSpec.model_validate(committed).model_dump(mode="json") == committed
    qwen = ModelSpec.model_validate({**old, "family": "qwen2", "attention_bias": True, "sliding_window": 8})
    assert ModelSpec.model_validate_json(qwen.model_dump_json()) == qwen
    with pytest.raises(ValueError, match="attention_bias"):
        ModelSpec.model_validate({**old, "attention_bias": True})
    with pytest.raises(ValueError, match="sliding_window"):
        ModelSpec.model_validate({**old, "sliding_window": 8})


@pytest.mark.parametrize("keys", [
    {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
     "head_dim": 32, "max_position_embeddings": 128},
    {"model_type": "mistral", "sliding_window": 5},
    {"model_type": "qwen2", "tie_word_embeddings": True},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0},
])
def test_to_hf_config_reads_back_the_same_spec(tmp_path: Path, keys: dict[str, Any]) -> None:
    spec = _read(tmp_path, **keys)
    config = to_hf_config(spec)
    assert config["model_type"] == spec.family and config["architectures"][0].endswith("ForCausalLM")
    again = spec_from_hf_dict(json.loads(json.dumps(config)))
    ignore = {"name", "max_position_embeddings"}
    assert again.model_dump(exclude=ignore) == spec.model_dump(exclude=ignore)


# ---- parameters, FLOPs, memory ----------------------------------------------------------------
def test_published_parameter_counts_of_other_families(tmp_path: Path) -> None:
    # Qwen2-0.5B (tied, q/k/v biases): 494,032,768 parameters (Qwen2 technical report / model card, 0.49B)
    qwen = spec_from_hf_dict({"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
                              "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
                              "vocab_size": 151936, "tie_word_embeddings": True})
    assert F.total_params(qwen) == 494_032_768
    assert F.layer_bias_params(qwen) == 896 + 2 * 128
    # Mistral-7B-v0.1: 7,241,732,096 parameters (model card: 7.24B)
    mistral = spec_from_hf_dict({"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
                                 "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                                 "vocab_size": 32000, "sliding_window": 4096})
    assert F.total_params(mistral) == 7_241_732_096


def test_biases_are_split_with_their_rows_and_count_in_memory() -> None:
    qwen = ModelSpec(name="q", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176,
                     vocab_size=256, family="qwen2", attention_bias=True)
    llama = PRESETS["llama-tiny-gqa"]
    assert F.layer_params(qwen) - F.layer_params(llama) == 64 + 2 * 32
    assert F.layer_params_per_device(qwen, 2) - F.layer_params_per_device(llama, 2) == (64 + 2 * 32) / 2
    assert sum(math.prod(i.shape) for i in model_params(qwen)) == F.total_params(qwen)


def test_window_limits_attention_flops_and_eager_scores() -> None:
    base = ModelSpec(name="m", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176,
                     vocab_size=256, family="mistral")
    windowed = base.model_copy(update={"sliding_window": 16})
    s, q = 64, F.q_width(base)
    assert F.model_flops_per_token(base, s) - F.model_flops_per_token(windowed, s) == 12 * 2 * (s - 16) * q
    assert F.layer_fwd_flops(windowed, 1, 8) == F.layer_fwd_flops(base, 1, 8)  # window >= s: no change
    # eager keeps exactly the blocks runtime/model/attention.py computes: count them from the masks it builds
    for seq, w in ((64, 16), (50, 16), (16, 5), (16, 16)):
        blocks = [(a, min(seq, a + w), max(0, a - w + 1)) for a in range(0, seq, w)] if w < seq else [(0, seq, 0)]
        held = sum(band_mask(a, z, k0, z, w, torch.device("cpu")).numel() for a, z, k0 in blocks)
        assert F.score_pairs(seq, w) == held <= seq * min(seq, 2 * w - 1)
    assert F.attention_score_elements(windowed, 2, s, 2) == 2 * 2 * F.score_pairs(s, 16) < 2 * 2 * s * s


def test_tied_embedding_reduction_is_costed_between_first_and_last_stage() -> None:
    cluster = build_cluster("1x2xA100-80G-SXM")

    def on_cluster(spec: ModelSpec) -> Plan:
        data = make_plan(spec, [(1, 2, [(1, (0, 2)), (1, (2, 4))])]).model_dump(mode="json", by_alias=True)
        for i, stage in enumerate(data["pipelines"][0]["stages"]):
            stage["devices"] = [cluster.device_ids[i]]
        return Plan.model_validate(data)

    tied = PRESETS["llama-tiny"].model_copy(update={"tie_embeddings": True})
    dp = dp_reduction(on_cluster(tied), cluster, CostParams())
    assert dp.stage_seconds[(0, 0)] > 0 and dp.partners[(0, 0)] == ((0, 1),)
    assert dp_reduction(on_cluster(PRESETS["llama-tiny"]), cluster, CostParams()).stage_seconds == {}


# ---- runtime pieces ---------------------------------------------------------------------------
def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """softmax over keys i - window < j <= i written out in full: q [b, s, hq, d], k/v [b, s, hkv, d]."""
    s, groups = q.shape[1], q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk.double()) / math.sqrt(q.shape[-1])
    i, j = torch.arange(s).unsqueeze(1), torch.arange(s).unsqueeze(0)
    scores = scores.masked_fill(~((j <= i) & (j > i - window)), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv.double()).float()


@pytest.mark.parametrize("backend", [SDPA, EAGER])
@pytest.mark.parametrize("seq, window", [(13, 4), (16, 5), (9, 9), (7, 30)])
def test_backends_honour_the_sliding_window(backend: str, seq: int, window: int) -> None:
    gen = torch.Generator().manual_seed(seq * window)
    q = torch.randn(2, seq, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, seq, 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, seq, 2, 8, generator=gen, requires_grad=True)
    got = attention_fn(backend, window)(q, k, v)
    want = _masked_attention(q, k, v, window)
    # fp32 attention of 8-wide heads over <= 30 keys against an fp64 reference: errors ~1e-7
    assert torch.allclose(got, want, atol=2e-6, rtol=0)
    if window >= seq:  # no window in effect: the causal path itself, bit for bit
        assert torch.equal(got, attention_fn(backend)(q, k, v))
    # the last query sees key 0 only when the window reaches back that far: no gradient flows there otherwise
    got[:, -1].sum().backward()
    assert k.grad is not None and (float(k.grad[:, 0].abs().max()) == 0.0) == (window < seq)


def test_llama3_frequency_remap_matches_the_piecewise_definition() -> None:
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    got = llama3_inv_freq(inv, scaling)
    for f, g in zip(inv.tolist(), got.tolist(), strict=True):
        wavelen = 2 * math.pi / f
        if wavelen < 64 / 4.0:
            want = f
        elif wavelen > 64 / 1.0:
            want = f / 8.0
        else:
            smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * f / 8.0 + smooth * f
        assert g == pytest.approx(want, rel=1e-12)
    assert (got == inv).any() and (got == inv / 8).any() and ((got < inv) & (got > inv / 8)).any()


def test_tied_model_has_one_table_and_the_last_stage_holds_a_copy() -> None:
    tied = PRESETS["llama-tiny"].model_copy(update={"tie_embeddings": True})
    names = [i.name for i in model_params(tied)]
    assert "head" not in names and names.count("embed") == 1
    assert [i.name for i in stage_params(tied, (2, 4), False, True)][-2:] == ["norm", "embed"]
    # one stage: the head projects with the embedding itself, whose gradient gets both uses
    module = StageModule(tied, (0, 1), True, True, TPContext(group=None))
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tokens = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    module(tokens[:, :-1], tokens[:, 1:]).backward()
    assert not hasattr(module, "head") and float(module.embed.grad.abs().sum()) > 0
    # a two-stage pipeline and a one-stage pipeline: each embed slice is reduced over all three holders
    plan = make_plan(tied, [(1, 1, [(2, (0, 2)), (1, (2, 4))]), (1, 1, [(1, (0, 4))])])
    embed = [sl for sl in slice_holders(plan) if sl.name == "embed"]
    assert [(sl.start, sl.stop, sl.ranks, sl.contributors) for sl in embed] == [
        (0, 128, (0, 2, 3), (0, 2, 3)), (128, 256, (1, 2, 3), (1, 2, 3))]
    single = make_plan(tied, [(1, 1, [(1, (0, 2)), (1, (2, 4))])])
    assert [sl.ranks for sl in slice_holders(single) if sl.needs_reduce] == [(0, 1)]
    owners = [(s.key, s.owner) for r in range(plan.world_size) for s in plan_shard_specs(plan, r)]
    assert sum(owner for key, owner in owners if key.startswith("embed@0:0:128")) == 1

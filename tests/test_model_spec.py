"""Model presets, Hugging Face configs, and their parameter counts against the published sizes."""

from __future__ import annotations

import json

import pytest

from flashflex_cli.errors import InputError
from flashflex_cli.model.flops import total_params
from flashflex_cli.model.hf_config import from_hf_config, resolve_model
from flashflex_cli.model.spec import PRESETS

# Published parameter counts (Touvron et al. 2023; Meta Llama 3 model cards), within 1 %.
PUBLISHED = {
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.02e9,
    "llama-30b": 32.5e9,
    "llama2-70b": 68.98e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.55e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_published(name: str) -> None:
    assert total_params(PRESETS[name]) == pytest.approx(PUBLISHED[name], rel=0.01)


def test_gqa_presets_have_fewer_kv_heads() -> None:
    for name in ("llama2-70b", "llama3-8b", "llama3-70b"):
        spec = PRESETS[name]
        assert spec.num_kv_heads < spec.num_heads and spec.num_heads % spec.num_kv_heads == 0


def test_hf_config_round_trip(tmp_path) -> None:
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "_name_or_path": "meta-llama/Meta-Llama-3-8B"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = resolve_model(str(path))
    reference = PRESETS["llama3-8b"]
    for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
        assert getattr(spec, field) == getattr(reference, field)
    assert total_params(spec) == total_params(reference)


def test_hf_config_defaults_kv_heads_to_heads(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "intermediate_size": 176, "vocab_size": 256}))
    assert from_hf_config(path).num_kv_heads == 4


@pytest.mark.parametrize("content, message", [
    ({"hidden_size": 64}, "missing"),
    ({"hidden_size": 66, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 8,
      "vocab_size": 8}, "num_heads"),
    ([1, 2], "JSON object"),
])
def test_bad_hf_config_is_input_error(tmp_path, content, message) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    with pytest.raises(InputError, match=message):
        from_hf_config(path)


def test_unknown_model_name_is_input_error() -> None:
    with pytest.raises(InputError, match="unknown model"):
        resolve_model("llama9-1t")


def test_tp_support() -> None:
    spec = PRESETS["llama3-8b"]  # 32 query heads, 8 kv heads
    assert spec.supports_tp(8) and not spec.supports_tp(16) and not spec.supports_tp(3)


def test_tied_embeddings_counted_once(tmp_path) -> None:
    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 176,
            "vocab_size": 256}
    untied, tied = tmp_path / "a.json", tmp_path / "b.json"
    untied.write_text(json.dumps(base))
    tied.write_text(json.dumps({**base, "tie_word_embeddings": True}))
    assert total_params(from_hf_config(untied)) - total_params(from_hf_config(tied)) == 256 * 64

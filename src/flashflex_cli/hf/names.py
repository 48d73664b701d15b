"""Global parameter names of the runtime (runtime/model/stage.py) <-> Hugging Face Llama-family tensor names.

Both sides store linear weights as [out_features, in_features], and the runtime's rotary embedding uses the
same "rotate_half" layout as transformers' Llama (the two halves of each head are rotated against each other),
so every tensor maps one to one, with no permutation (tests/test_hf_io.py checks logits against
LlamaForCausalLM).
"""

from __future__ import annotations

import re

# runtime suffix inside "layers.{i}." -> Hugging Face suffix inside "model.layers.{i}."
_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "attn.wq": "self_attn.q_proj.weight",
    "attn.wk": "self_attn.k_proj.weight",
    "attn.wv": "self_attn.v_proj.weight",
    "attn.bq": "self_attn.q_proj.bias",
    "attn.bk": "self_attn.k_proj.bias",
    "attn.bv": "self_attn.v_proj.bias",
    "attn.wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "mlp.w_gate": "mlp.gate_proj.weight",
    "mlp.w_up": "mlp.up_proj.weight",
    "mlp.w_down": "mlp.down_proj.weight",
}
_TOP = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
_LAYER_BACK = {hf: ours for ours, hf in _LAYER.items()}
_TOP_BACK = {hf: ours for ours, hf in _TOP.items()}
_OURS = re.compile(r"^layers\.(\d+)\.(.+)$")
_THEIRS = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

HEAD = "head"
HF_HEAD = _TOP[HEAD]


def to_hf(name: str) -> str:
    """The Hugging Face tensor name of runtime global parameter `name` (KeyError when it has none)."""
    if name in _TOP:
        return _TOP[name]
    match = _OURS.match(name)
    if match is None or match.group(2) not in _LAYER:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}"


def from_hf(name: str) -> str | None:
    """The runtime global parameter name of Hugging Face tensor `name`, None for a tensor the runtime does not
    hold (rotary inverse frequencies and the like)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    match = _THEIRS.match(name)
    if match is None or match.group(2) not in _LAYER_BACK:
        return None
    return f"layers.{match.group(1)}.{_LAYER_BACK[match.group(2)]}"

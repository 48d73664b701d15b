"""Deterministic initial weights, independent of the plan: every parameter is drawn as a FULL tensor on the
CPU from a generator seeded by sha256(seed, global parameter name), then sliced to a rank's shard. So the same
seed gives the same model whatever the pipeline, stage and TP layout (and whatever the device).

Scheme (GPT-2 / Llama practice): normal(0, 0.02) for embeddings, projections and the head; the residual
output projections (attn.wo, mlp.w_down) scaled by 1/sqrt(2 * num_layers); norm weights are ones; q/k/v
biases (Qwen2) are zeros. A tied model has no "head": its output projection is "embed", drawn once.
"""

from __future__ import annotations

import hashlib
import math

import torch

from ..model.spec import ModelSpec

INIT_STD = 0.02
BIASES = ("attn.bq", "attn.bk", "attn.bv")


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed derived from the run seed and a global parameter name."""
    digest = hashlib.sha256(f"flashflex:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_init(spec: ModelSpec, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 CPU tensor of global parameter `name` (shape `shape`) for run seed `seed`."""
    if name.endswith("norm"):
        return torch.ones(shape, dtype=torch.float32)
    if name.endswith(BIASES):
        return torch.zeros(shape, dtype=torch.float32)
    std = INIT_STD
    if name.endswith(("attn.wo", "mlp.w_down")):
        std = INIT_STD / math.sqrt(2 * spec.num_layers)
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=generator, dtype=torch.float32) * std

"""The Llama-family decoder built for one pipeline stage (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP), with tensor parallelism over an explicitly passed `TPContext`.

Global parameter names (plan-independent; weights [out, in] like torch.nn.Linear):
  "embed" [vocab, hidden] (first stage; vocabulary-parallel, dim 0)
  "layers.{i}.attn_norm" [hidden], "layers.{i}.mlp_norm" [hidden] (replicated)
  "layers.{i}.attn.wq" [heads*hd, hidden], ".wk"/".wv" [kv_heads*hd, hidden] (column-parallel, dim 0, by heads)
  "layers.{i}.attn.wo" [hidden, heads*hd] (row-parallel, dim 1)
  "layers.{i}.mlp.w_gate"/".w_up" [ffn, hidden] (column-parallel, dim 0, matching halves), ".w_down" [hidden, ffn]
  "norm" [hidden] (replicated), "head" [vocab, hidden] (last stage; vocabulary-parallel, dim 0)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model.spec import ModelSpec
from .attention import SDPA, attention_fn
from .tensor_parallel import (
    TPContext,
    copy_to_tp,
    row_linear,
    shard_bounds,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)


@dataclass(frozen=True)
class ParamInfo:
    """A global parameter: name, full shape, and the dimension TP splits (None = replicated)."""

    name: str
    shape: tuple[int, ...]
    shard_dim: int | None

    def bounds(self, tp: int, tp_rank: int) -> tuple[int, int]:
        """[start, stop) along `shard_dim` held by `tp_rank` of `tp` (the whole length when replicated)."""
        if self.shard_dim is None:
            return 0, self.shape[0]
        return shard_bounds(self.shape[self.shard_dim], tp, tp_rank)

    def local_shape(self, tp: int, tp_rank: int) -> tuple[int, ...]:
        """Shape of the shard held by `tp_rank` of `tp`."""
        if self.shard_dim is None:
            return self.shape
        start, stop = self.bounds(tp, tp_rank)
        shape = list(self.shape)
        shape[self.shard_dim] = stop - start
        return tuple(shape)

    def take(self, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
        """This shard of the full tensor (a view)."""
        if self.shard_dim is None:
            return full
        start, stop = self.bounds(tp, tp_rank)
        return full.narrow(self.shard_dim, start, stop - start)


def layer_params(spec: ModelSpec, i: int) -> list[ParamInfo]:
    """The parameters of transformer layer `i`, in module order."""
    h, hd, ffn = spec.hidden_size, spec.head_dim, spec.intermediate_size
    p = f"layers.{i}."
    return [
        ParamInfo(p + "attn_norm", (h,), None),
        ParamInfo(p + "attn.wq", (spec.num_heads * hd, h), 0),
        ParamInfo(p + "attn.wk", (spec.num_kv_heads * hd, h), 0),
        ParamInfo(p + "attn.wv", (spec.num_kv_heads * hd, h), 0),
        ParamInfo(p + "attn.wo", (h, spec.num_heads * hd), 1),
        ParamInfo(p + "mlp_norm", (h,), None),
        ParamInfo(p + "mlp.w_gate", (ffn, h), 0),
        ParamInfo(p + "mlp.w_up", (ffn, h), 0),
        ParamInfo(p + "mlp.w_down", (h, ffn), 1),
    ]


def stage_params(spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool) -> list[ParamInfo]:
    """Global parameters held by a stage running `layers` [start, stop), in a fixed order."""
    out: list[ParamInfo] = []
    if first:
        out.append(ParamInfo("embed", (spec.vocab_size, spec.hidden_size), 0))
    for i in range(*layers):
        out.extend(layer_params(spec, i))
    if last:
        out.append(ParamInfo("norm", (spec.hidden_size,), None))
        out.append(ParamInfo("head", (spec.vocab_size, spec.hidden_size), 0))
    return out


def model_params(spec: ModelSpec) -> list[ParamInfo]:
    """Every global parameter of the model, in a fixed order."""
    return stage_params(spec, (0, spec.num_layers), True, True)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32. x [..., hidden]."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, ...]:
    """cos, sin tables [seq_len, 1, head_dim] (fp32) for positions 0..seq_len-1 (Su et al. 2021, half split)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().unsqueeze(1), emb.sin().float().unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, heads, hd] by position; cos/sin [s, 1, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention over this rank's heads: q heads and kv heads split by TP."""

    def __init__(self, spec: ModelSpec, tp: TPContext, backend: str) -> None:
        super().__init__()
        self.tp, self.hd = tp, spec.head_dim
        self.hq, self.hkv = spec.num_heads // tp.size, spec.num_kv_heads // tp.size
        h = spec.hidden_size
        self.wq = nn.Parameter(torch.empty(self.hq * self.hd, h))
        self.wk = nn.Parameter(torch.empty(self.hkv * self.hd, h))
        self.wv = nn.Parameter(torch.empty(self.hkv * self.hd, h))
        self.wo = nn.Parameter(torch.empty(h, self.hq * self.hd))
        self.attend = attention_fn(backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        x = copy_to_tp(x, self.tp)
        q = apply_rotary(F.linear(x, self.wq).view(b, s, self.hq, self.hd), cos, sin)
        k = apply_rotary(F.linear(x, self.wk).view(b, s, self.hkv, self.hd), cos, sin)
        v = F.linear(x, self.wv).view(b, s, self.hkv, self.hd)
        out = self.attend(q, k, v).reshape(b, s, self.hq * self.hd)
        return row_linear(out, self.wo, self.tp)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up column-parallel (matching halves) and down row-parallel."""

    def __init__(self, spec: ModelSpec, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        ffn, h = spec.intermediate_size // tp.size, spec.hidden_size
        self.w_gate = nn.Parameter(torch.empty(ffn, h))
        self.w_up = nn.Parameter(torch.empty(ffn, h))
        self.w_down = nn.Parameter(torch.empty(h, ffn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp)
        return row_linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down, self.tp)


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h)). x [b, s, hidden] replicated."""

    def __init__(self, spec: ModelSpec, tp: TPContext, backend: str) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = Attention(spec, tp, backend)
        self.mlp_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = SwiGLU(spec, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin)
        return h + self.mlp(self.mlp_norm(h))


class StageModule(nn.Module):
    """Layers [start, stop) of the model on one TP rank; the first stage embeds, the last one norms, projects to
    the vocabulary and returns the summed token loss.

    forward(x, targets): x = tokens int64 [b, s] (first stage) or hidden fp32 [b, s, hidden]; returns hidden
    [b, s, hidden] (replicated over the TP group), or on the last stage the fp32 scalar SUM of per-token
    cross-entropy over the b*s targets (int64 [b, s]).
    """

    def __init__(self, spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool, tp: TPContext,
                 backend: str = SDPA, recompute: bool = False) -> None:
        super().__init__()
        self.spec, self.layer_range, self.first, self.last, self.tp = spec, layers, first, last, tp
        self.recompute = recompute
        self.infos = stage_params(spec, layers, first, last)
        vocab_start, vocab_stop = shard_bounds(spec.vocab_size, tp.size, tp.rank)
        self.vocab_start = vocab_start
        if first:
            self.embed = nn.Parameter(torch.empty(vocab_stop - vocab_start, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(spec, tp, backend) for _ in range(*layers))
        if last:
            self.norm = RMSNorm(spec.hidden_size, spec.norm_eps)
            self.head = nn.Parameter(torch.empty(vocab_stop - vocab_start, spec.hidden_size))
        self._rope: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}

    def global_parameters(self) -> list[tuple[ParamInfo, nn.Parameter]]:
        """(global info, local shard parameter) pairs in the order of `stage_params`."""
        out: list[tuple[ParamInfo, nn.Parameter]] = []
        by_local = dict(self.named_parameters())
        start = self.layer_range[0]
        for info in self.infos:
            if info.name.startswith("layers."):
                _, idx, rest = info.name.split(".", 2)
                local = f"layers.{int(idx) - start}.{rest}"
                local = local + ".weight" if rest.endswith("norm") else local
            else:
                local = "norm.weight" if info.name == "norm" else info.name
            out.append((info, by_local[local]))
        return out

    def _tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        key = (seq_len, str(device))
        if key not in self._rope:
            self._rope[key] = rotary_tables(seq_len, self.spec.head_dim, self.spec.rope_theta, device)
        return self._rope[key]

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = vocab_parallel_embedding(x, self.embed, self.vocab_start, self.tp)
        cos, sin = self._tables(x.shape[1], x.device)
        for layer in self.layers:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        if not self.last:
            return x
        assert targets is not None, "the last stage needs targets"
        h = copy_to_tp(self.norm(x), self.tp)
        logits = F.linear(h, self.head)
        losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                              self.vocab_start, self.tp)
        return losses.sum()

"""The Llama-family decoder (Llama, Mistral, Qwen2) built for one pipeline stage (RMSNorm, rotary embeddings
with optional Llama 3.1 scaling, grouped-query attention with optional q/k/v biases and sliding window, SwiGLU
MLP), with tensor parallelism over an explicitly passed `TPContext`.

Global parameter names (plan-independent; weights [out, in] like torch.nn.Linear):
  "embed" [vocab, hidden] (first stage; vocabulary-parallel, dim 0)
  "layers.{i}.attn_norm" [hidden], "layers.{i}.mlp_norm" [hidden] (replicated)
  "layers.{i}.attn.wq" [heads*hd, hidden], ".wk"/".wv" [kv_heads*hd, hidden] (column-parallel, dim 0, by heads)
  "layers.{i}.attn.bq" [heads*hd], ".bk"/".bv" [kv_heads*hd] (attention_bias only; split like wq/wk/wv rows)
  "layers.{i}.attn.wo" [hidden, heads*hd] (row-parallel, dim 1)
  "layers.{i}.mlp.w_gate"/".w_up" [ffn, hidden] (column-parallel, dim 0, matching halves), ".w_down" [hidden, ffn]
  "norm" [hidden] (replicated), "head" [vocab, hidden] (last stage; vocabulary-parallel, dim 0)
Tied embeddings: there is no "head"; the last stage holds its own shard of "embed" and projects with it. When
the first and last stages differ, both hold "embed" (same init), their gradients are summed before the
optimizer step (runtime/parallel/groups.py lists both stages as holders), so the copies stay bit-identical.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional
from torch.utils.checkpoint import checkpoint

from ...model.spec import ModelSpec, RopeScaling
from ...semantics.parameters import ParamInfo, shard_bounds, stage_params
from ...semantics.runtime_paths import loss_chunk_tokens
from .attention import SDPA, attention_fn
from .chunked_loss import EAGER_KERNELS, LossKernels, chunked_head_loss
from .tensor_parallel import (
    TPContext,
    copy_to_tp,
    row_linear,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from .torch_loss import available as torch_loss_available
from .torch_loss import torch_head_loss
from .working_weights import shared_cast


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32. x [..., hidden]."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 remapping of rotary inverse frequencies f (radians per token; Meta's Llama 3.1 release).

    With wavelength L = 2 pi / f and the pre-training context C = original_max_position_embeddings, the
    new frequency is f * ((1 - a) / factor + a), a = clamp((C / L - low_freq_factor) / (high_freq_factor -
    low_freq_factor), 0, 1): waves shorter than C / high_freq_factor keep f (a = 1), waves longer than
    C / low_freq_factor get f / factor (a = 0), the band between is blended linearly in C / L."""
    ratio = scaling.original_max_position_embeddings * inv_freq / (2 * math.pi)  # C / L
    a = ((ratio - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)).clamp(0.0, 1.0)
    return inv_freq * ((1.0 - a) / scaling.factor + a)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                  scaling: RopeScaling | None = None) -> tuple[torch.Tensor, ...]:
    """cos, sin tables [seq_len, 1, head_dim] (fp32) for positions 0..seq_len-1 (Su et al. 2021, half split),
    frequencies remapped by `scaling` (Llama 3.1) when given."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    if scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float().unsqueeze(1), emb.sin().float().unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, heads, hd] by position; cos/sin [s, 1, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Matmuls(nn.Module):
    """A module of matrix products whose weights may be multiplied as 16-bit working copies made once per step
    (`working`: parameter name -> copy, filled by runtime/model/working_weights.py; empty: the fp32 parameters,
    which autocast casts)."""

    def __init__(self) -> None:
        super().__init__()
        self.working: dict[str, torch.Tensor] = {}

    def weight(self, name: str) -> torch.Tensor:
        """The matrix `name` as the product takes it: its working copy (gradient into the parameter), or the
        parameter."""
        param = getattr(self, name)
        copy = self.working.get(name)
        return param if copy is None else shared_cast(param, copy)


class Attention(Matmuls):
    """Grouped-query causal self-attention over this rank's heads: q heads and kv heads split by TP; q/k/v
    biases (Qwen2) split with their rows; a sliding window (Mistral) when the spec has one."""

    def __init__(self, spec: ModelSpec, tp: TPContext, backend: str) -> None:
        super().__init__()
        self.tp, self.hd = tp, spec.head_dim
        self.hq, self.hkv = spec.num_heads // tp.size, spec.num_kv_heads // tp.size
        h = spec.hidden_size
        self.wq = nn.Parameter(torch.empty(self.hq * self.hd, h))
        self.wk = nn.Parameter(torch.empty(self.hkv * self.hd, h))
        self.wv = nn.Parameter(torch.empty(self.hkv * self.hd, h))
        for name, rows in (("bq", self.hq * self.hd), ("bk", self.hkv * self.hd), ("bv", self.hkv * self.hd)):
            self.register_parameter(name, nn.Parameter(torch.empty(rows)) if spec.attention_bias else None)
        self.wo = nn.Parameter(torch.empty(h, self.hq * self.hd))
        self.attend = attention_fn(backend, spec.sliding_window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        x = copy_to_tp(x, self.tp)
        q = apply_rotary(functional.linear(x, self.weight("wq"), self.bq).view(b, s, self.hq, self.hd), cos, sin)
        k = apply_rotary(functional.linear(x, self.weight("wk"), self.bk).view(b, s, self.hkv, self.hd), cos, sin)
        v = functional.linear(x, self.weight("wv"), self.bv).view(b, s, self.hkv, self.hd)
        out = self.attend(q, k, v).reshape(b, s, self.hq * self.hd)
        return row_linear(out, self.weight("wo"), self.tp)


class SwiGLU(Matmuls):
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
        gated = functional.silu(functional.linear(x, self.weight("w_gate")))
        return row_linear(gated * functional.linear(x, self.weight("w_up")), self.weight("w_down"), self.tp)


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


@dataclass(frozen=True)
class StageRunners:
    """What a stage's forward calls: each decoder layer (the module, or its compiled form), the final norm (last
    stage only) and the chunked loss's per-chunk functions. A plain object, so nn.Module registers nothing of it
    and parameter names stay those of the modules."""

    layers: tuple[Callable[..., torch.Tensor], ...]
    norm: Callable[[torch.Tensor], torch.Tensor] | None
    loss: LossKernels
    whole: Callable[..., torch.Tensor] | None = None  # the whole forward compiled as one (compile_scope "stage")


class StageModule(nn.Module):
    """Layers [start, stop) of the model on one TP rank; the first stage embeds, the last one norms, projects to
    the vocabulary (with "head", or with its "embed" shard when embeddings are tied) and returns the summed
    token loss.

    forward(x, targets): x = tokens int64 [b, s] (first stage) or hidden fp32 [b, s, hidden]; returns hidden
    [b, s, hidden] (replicated over the TP group), or on the last stage the fp32 scalar SUM of per-token
    cross-entropy over the b*s targets (int64 [b, s]).

    `chunked_loss`: the projection and loss in chunks of `loss_chunk_tokens` tokens (runtime/model/chunked_loss.py,
    no [b*s, vocab] fp32 logits); False: the whole logits tensor, upcast to fp32 for the loss.
    `loss_kernel`: "torch" runs the chunked loss through torch's `linear_cross_entropy` where it fits (TP 1, a
    torch that has it: runtime/model/torch_loss.py), "own" (and everywhere else) the project's.
    `capture_logits`: None, or a list to which the last stage appends each forward's detached logits shard
    [b, s, vocab / tp] (vocabulary rows [vocab_start, +vocab / tp)) in the compute dtype; for equivalence tests.

    What runs is `runners` (`StageRunners`): each layer, the final norm and the chunked loss's per-chunk
    functions, as they are or compiled (runtime/model/compiled.py); compiling never renames a parameter.
    """

    def __init__(self, spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool, tp: TPContext,
                 backend: str = SDPA, recompute: bool = False, chunked_loss: bool = False,
                 loss_kernel: str = "own") -> None:
        super().__init__()
        self.spec, self.layer_range, self.first, self.last, self.tp = spec, layers, first, last, tp
        self.recompute, self.chunked_loss = recompute, chunked_loss
        self.torch_loss = loss_kernel == "torch" and tp.size == 1 and torch_loss_available()
        self.infos = stage_params(spec, layers, first, last)
        vocab_start, vocab_stop = shard_bounds(spec.vocab_size, tp.size, tp.rank)
        self.vocab_start = vocab_start
        if first or (last and spec.tie_embeddings):
            self.embed = nn.Parameter(torch.empty(vocab_stop - vocab_start, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(spec, tp, backend) for _ in range(*layers))
        if last:
            self.norm = RMSNorm(spec.hidden_size, spec.norm_eps)
            if not spec.tie_embeddings:
                self.head = nn.Parameter(torch.empty(vocab_stop - vocab_start, spec.hidden_size))
        self._rope: dict[tuple[int, str], tuple[torch.Tensor, ...]] = {}
        self.capture_logits: list[torch.Tensor] | None = None
        self.loss_chunk_tokens = loss_chunk_tokens(vocab_stop - vocab_start)
        self.runners = StageRunners(tuple(self.layers), self.norm if last else None, EAGER_KERNELS)

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
            self._rope[key] = rotary_tables(seq_len, self.spec.head_dim, self.spec.rope_theta, device,
                                            self.spec.rope_scaling)
        return self._rope[key]

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        cos, sin = self._tables(x.shape[1], x.device)  # the cache filled outside any compiled graph
        if self.runners.whole is not None:  # contiguous: the graph was made for the warm-up's layout
            return self.runners.whole(x.contiguous(), targets.contiguous() if targets is not None else None, cos,
                                      sin)
        return self.run_parts(x, targets, cos, sin)

    def run_parts(self, x: torch.Tensor, targets: torch.Tensor | None, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
        """The forward, part by part through `runners` (what `forward` runs, or compiles whole); cos, sin: the
        rotary tables [s, 1, head_dim]."""
        if self.first:
            x = vocab_parallel_embedding(x, self.embed, self.vocab_start, self.tp)
        for layer in self.runners.layers:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        if not self.last:
            return x
        assert targets is not None and self.runners.norm is not None, "the last stage needs targets"
        h = copy_to_tp(self.runners.norm(x), self.tp)
        weight = self.embed if self.spec.tie_embeddings else self.head
        if self.chunked_loss and self.torch_loss and self.capture_logits is None:
            return torch_head_loss(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), self.loss_chunk_tokens)
        if self.chunked_loss:
            chunks: list[torch.Tensor] | None = [] if self.capture_logits is not None else None
            loss = chunked_head_loss(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), self.vocab_start,
                                     self.tp, self.loss_chunk_tokens, self.runners.loss, chunks)
            if self.capture_logits is not None and chunks is not None:
                self.capture_logits.append(torch.cat(chunks).view(*h.shape[:-1], weight.shape[0]))
            return loss
        logits = functional.linear(h, weight)
        if self.capture_logits is not None:
            self.capture_logits.append(logits.detach().clone())
        losses = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                              self.vocab_start, self.tp)
        return losses.sum()

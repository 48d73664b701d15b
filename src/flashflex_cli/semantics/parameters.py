"""Which parameters a pipeline stage holds and how tensor parallelism cuts each one: the naming and sharding
both the runtime (building, checkpointing and reducing the stage's tensors) and the Hugging Face weight files
(hf/: names, slicing on load) follow. Torch-free: shapes and index ranges only.

Global names and shapes are listed in runtime/model/stage.py's docstring; `shard_dim` is the dimension a TP group
splits (0: column-parallel weights and the vocabulary-parallel embedding and head; 1: row-parallel weights;
None: replicated norms). Shards are floor splits, nested across degrees (`shard_bounds`), so a shard of a TP-2
group is exactly the union of two shards of a TP-4 group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model.spec import ModelSpec

if TYPE_CHECKING:
    import torch


def shard_bounds(n: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """Rows [start, stop) of an n-long dimension held by `tp_rank` of `tp` (floor split, nested across degrees)."""
    return n * tp_rank // tp, n * (tp_rank + 1) // tp


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
    q_rows, kv_rows = spec.num_heads * hd, spec.num_kv_heads * hd
    out = [
        ParamInfo(p + "attn_norm", (h,), None),
        ParamInfo(p + "attn.wq", (q_rows, h), 0),
        ParamInfo(p + "attn.wk", (kv_rows, h), 0),
        ParamInfo(p + "attn.wv", (kv_rows, h), 0),
    ]
    if spec.attention_bias:
        out += [ParamInfo(p + "attn.bq", (q_rows,), 0), ParamInfo(p + "attn.bk", (kv_rows,), 0),
                ParamInfo(p + "attn.bv", (kv_rows,), 0)]
    return out + [
        ParamInfo(p + "attn.wo", (h, q_rows), 1),
        ParamInfo(p + "mlp_norm", (h,), None),
        ParamInfo(p + "mlp.w_gate", (ffn, h), 0),
        ParamInfo(p + "mlp.w_up", (ffn, h), 0),
        ParamInfo(p + "mlp.w_down", (h, ffn), 1),
    ]


def stage_params(spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool) -> list[ParamInfo]:
    """Global parameters held by a stage running `layers` [start, stop), in a fixed order. With tied
    embeddings the last stage holds "embed" (its output projection) instead of "head"; once when it is also
    the first stage."""
    embed = ParamInfo("embed", (spec.vocab_size, spec.hidden_size), 0)
    out: list[ParamInfo] = [embed] if first else []
    for i in range(*layers):
        out.extend(layer_params(spec, i))
    if last:
        out.append(ParamInfo("norm", (spec.hidden_size,), None))
        if not spec.tie_embeddings:
            out.append(ParamInfo("head", (spec.vocab_size, spec.hidden_size), 0))
        elif not first:
            out.append(embed)
    return out


def model_params(spec: ModelSpec) -> list[ParamInfo]:
    """Every global parameter of the model, in a fixed order (a tied model has no "head")."""
    return stage_params(spec, (0, spec.num_layers), True, True)

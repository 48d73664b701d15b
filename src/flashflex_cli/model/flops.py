"""Per-layer parameters, FLOPs and activation bytes of a Llama-family decoder.

Notation: b = micro-batch size (sequences), s = sequence length (tokens), h = hidden size,
k = key/value width (num_kv_heads * head_dim, smaller than h under grouped-query attention),
f = MLP intermediate size, V = vocabulary size, L = number of layers, t = tensor-parallel degree.

FLOPs count multiply-adds as 2 FLOPs and only matrix multiplications (the convention of
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", eq. 3, and of
the PaLM paper, Chowdhery et al. 2022, appendix B). Attention scores and the weighted sum are counted
in full (not halved for the causal mask), as both sources do:

    forward FLOPs per token of one layer = 2 * P_matmul + 4 * s * h
    model FLOPs per token (training)     = 6 * N + 12 * L * s * h      (PaLM appendix B)

where P_matmul are the layer's matrix weights and N = L * P_matmul + V * h (the output head is a
matmul; the input embedding is a lookup and costs no FLOPs). Backward is twice the forward; full
activation recompute adds one more forward to the backward pass (Korthikanti et al. 2022).
"""

from __future__ import annotations

from .spec import ModelSpec

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a training dtype ("bf16", "fp16", "fp32", "tf32": fp32 storage)."""
    return DTYPE_BYTES[dtype]


def kv_width(model: ModelSpec) -> int:
    """Width of the key (and of the value) projection: num_kv_heads * head_dim."""
    return model.num_kv_heads * model.head_dim


# ---- parameters -------------------------------------------------------------------------------
def layer_matmul_params(model: ModelSpec) -> int:
    """Matrix weights of one transformer layer: q and o (h*h each), k and v (h*k each), SwiGLU (3*h*f)."""
    h, k, f = model.hidden_size, kv_width(model), model.intermediate_size
    return 2 * h * h + 2 * h * k + 3 * h * f


def layer_params(model: ModelSpec) -> int:
    """All parameters of one transformer layer: matmul weights plus two RMSNorm gains (2*h)."""
    return layer_matmul_params(model) + 2 * model.hidden_size


def layer_params_per_device(model: ModelSpec, tp: int) -> float:
    """Parameters one device of a TP group of degree `tp` holds for one layer.

    Matmul weights are split `tp` ways (Megatron column/row parallel); norm gains are replicated.
    """
    return layer_matmul_params(model) / tp + 2 * model.hidden_size


def embedding_params(model: ModelSpec) -> int:
    """Input embedding table: V * h."""
    return model.vocab_size * model.hidden_size


def head_params(model: ModelSpec) -> int:
    """Final RMSNorm (h) plus the output projection (V * h; a separate copy even when tied, as in Megatron)."""
    return model.hidden_size + model.vocab_size * model.hidden_size


def total_params(model: ModelSpec) -> int:
    """Parameters of the whole model (tied embeddings counted once)."""
    head = model.hidden_size + (0 if model.tie_embeddings else embedding_params(model))
    return model.num_layers * layer_params(model) + embedding_params(model) + head


# ---- FLOPs ------------------------------------------------------------------------------------
def layer_fwd_flops(model: ModelSpec, micro_batch: int, seq_len: int) -> float:
    """Forward FLOPs of one layer for one micro-batch of [micro_batch, seq_len] tokens (whole TP group)."""
    tokens = micro_batch * seq_len
    return tokens * (2.0 * layer_matmul_params(model) + 4.0 * seq_len * model.hidden_size)


def layer_bwd_flops(model: ModelSpec, micro_batch: int, seq_len: int, recompute: bool = False) -> float:
    """Backward FLOPs of one layer and micro-batch: 2x forward, plus one forward when recomputing."""
    fwd = layer_fwd_flops(model, micro_batch, seq_len)
    return (3.0 if recompute else 2.0) * fwd


def head_fwd_flops(model: ModelSpec, micro_batch: int, seq_len: int) -> float:
    """Forward FLOPs of the output projection [b*s, h] x [h, V] for one micro-batch."""
    return 2.0 * micro_batch * seq_len * model.hidden_size * model.vocab_size


def head_bwd_flops(model: ModelSpec, micro_batch: int, seq_len: int) -> float:
    """Backward FLOPs of the output projection (input and weight gradients): 2x forward."""
    return 2.0 * head_fwd_flops(model, micro_batch, seq_len)


def model_matmul_params(model: ModelSpec) -> int:
    """N of the 6N rule: every weight that takes part in a matmul per token (layers and output head)."""
    return model.num_layers * layer_matmul_params(model) + model.vocab_size * model.hidden_size


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token, 6N + 12*L*s*h (PaLM appendix B); recompute is not model FLOPs."""
    return 6.0 * model_matmul_params(model) + 12.0 * model.num_layers * seq_len * model.hidden_size


# ---- activations ------------------------------------------------------------------------------
def layer_activation_bytes(model: ModelSpec, micro_batch: int, seq_len: int, tp: int = 1,
                           dtype: str = "bf16") -> float:
    """Bytes one device keeps alive for the backward of one layer and one micro-batch (no recompute).

    Saved tensors of a Llama layer with a fused (flash) attention, which stores no s x s scores:
    replicated across the TP group: the layer input, the first norm output, the residual after
    attention and the second norm output (4 tensors of [b, s, h]); split `tp` ways: q and the
    attention output ([b, s, h] each), k and v ([b, s, k] each), and in the SwiGLU MLP the gate
    output, the up output, silu(gate) and the product ([b, s, f] each). Derivation follows
    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), sec. 4.1.
    """
    h, k, f = model.hidden_size, kv_width(model), model.intermediate_size
    per_token_elems = 4 * h + (2 * h + 2 * k + 4 * f) / tp
    return micro_batch * seq_len * per_token_elems * dtype_bytes(dtype)


def attention_score_elements(model: ModelSpec, micro_batch: int, seq_len: int, tp: int = 1) -> float:
    """Elements of the [b, heads / tp, s, s] attention probabilities one device holds for one layer and
    micro-batch: what a non-fused (eager) attention keeps for its backward on top of
    `layer_activation_bytes` (a fused kernel recomputes them)."""
    return micro_batch * (model.num_heads / tp) * float(seq_len) * seq_len


def layer_input_bytes(model: ModelSpec, micro_batch: int, seq_len: int, dtype: str = "bf16") -> float:
    """Bytes of one layer's input [b, s, h]: what full recompute keeps per layer and micro-batch,
    and what one pipeline stage sends to the next."""
    return micro_batch * seq_len * model.hidden_size * dtype_bytes(dtype)


def logits_bytes(model: ModelSpec, micro_batch: int, seq_len: int, tp: int = 1, dtype: str = "bf16") -> float:
    """Bytes of the logits of one micro-batch on one device of the last stage.

    The [b, s, V/tp] logits in the training dtype, plus the fp32 copy the loss computes its softmax in.
    """
    return micro_batch * seq_len * (model.vocab_size / tp) * (dtype_bytes(dtype) + 4)

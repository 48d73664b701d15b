"""Per-layer parameters, FLOPs and activation bytes of a Llama-family decoder (Llama, Mistral, Qwen2).

Notation: b = micro-batch size (sequences), s = sequence length (tokens), h = hidden size,
q = query width (num_heads * head_dim; h unless the config sets head_dim), k = key/value width
(num_kv_heads * head_dim, smaller than q under grouped-query attention), f = MLP intermediate size,
V = vocabulary size, L = number of layers, t = tensor-parallel degree, w = keys one query attends to:
s, or min(s, sliding_window) for a windowed model (Mistral).

FLOPs count multiply-adds as 2 FLOPs and only matrix multiplications (the convention of
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters", eq. 3, and of
the PaLM paper, Chowdhery et al. 2022, appendix B). Attention scores and the weighted sum are counted
in full over the keys a query may see (not halved for the causal mask), as both sources do:

    forward FLOPs per token of one layer = 2 * P_matmul + 4 * w * q
    model FLOPs per token (training)     = 6 * N + 12 * L * w * q      (PaLM appendix B, with w = s, q = h)

where P_matmul are the layer's matrix weights and N = L * P_matmul + V * h (the output head is a
matmul, also when it is tied to the input embedding; the embedding is a lookup and costs no FLOPs).
Biases (Qwen2's q/k/v) are parameters but additions, not matmul FLOPs. Backward is twice the forward;
full activation recompute adds one more forward to the backward pass (Korthikanti et al. 2022).
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


def q_width(model: ModelSpec) -> int:
    """Width of the query projection and of the attention output: num_heads * head_dim."""
    return model.num_heads * model.head_dim


def attended_keys(model: ModelSpec, seq_len: int) -> int:
    """Keys one query attends to in the full-square count: s, or min(s, sliding_window)."""
    return seq_len if model.sliding_window is None else min(seq_len, model.sliding_window)


# ---- parameters -------------------------------------------------------------------------------
def layer_matmul_params(model: ModelSpec) -> int:
    """Matrix weights of one transformer layer: q and o (h*q each), k and v (h*k each), SwiGLU (3*h*f)."""
    h, q, k, f = model.hidden_size, q_width(model), kv_width(model), model.intermediate_size
    return 2 * h * q + 2 * h * k + 3 * h * f


def layer_bias_params(model: ModelSpec) -> int:
    """Biases of one layer: q + 2*k for Qwen2's q/k/v projections, else 0."""
    return q_width(model) + 2 * kv_width(model) if model.attention_bias else 0


def layer_params(model: ModelSpec) -> int:
    """All parameters of one transformer layer: matmul weights, biases and two RMSNorm gains (2*h)."""
    return layer_matmul_params(model) + layer_bias_params(model) + 2 * model.hidden_size


def layer_params_per_device(model: ModelSpec, tp: int) -> float:
    """Parameters one device of a TP group of degree `tp` holds for one layer.

    Matmul weights and the q/k/v biases (split with their rows) are split `tp` ways (Megatron column/row
    parallel); norm gains are replicated.
    """
    return (layer_matmul_params(model) + layer_bias_params(model)) / tp + 2 * model.hidden_size


def embedding_params(model: ModelSpec) -> int:
    """Input embedding table: V * h."""
    return model.vocab_size * model.hidden_size


def head_params(model: ModelSpec) -> int:
    """Final RMSNorm (h) plus the output projection (V * h) the last stage holds: a separate copy of the
    embedding even when tied (kept identical by a gradient reduction with the first stage), so memory and
    gradient traffic count it there; `total_params` counts a tied table once."""
    return model.hidden_size + model.vocab_size * model.hidden_size


def total_params(model: ModelSpec) -> int:
    """Parameters of the whole model (tied embeddings counted once)."""
    head = model.hidden_size + (0 if model.tie_embeddings else embedding_params(model))
    return model.num_layers * layer_params(model) + embedding_params(model) + head


# ---- FLOPs ------------------------------------------------------------------------------------
def layer_fwd_flops(model: ModelSpec, micro_batch: int, seq_len: int) -> float:
    """Forward FLOPs of one layer for one micro-batch of [micro_batch, seq_len] tokens (whole TP group)."""
    tokens = micro_batch * seq_len
    return tokens * (2.0 * layer_matmul_params(model) + 4.0 * attended_keys(model, seq_len) * q_width(model))


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
    """Training FLOPs per token, 6N + 12*L*w*q (PaLM appendix B); recompute is not model FLOPs."""
    return 6.0 * model_matmul_params(model) + 12.0 * model.num_layers * attended_keys(model, seq_len) * q_width(model)


# ---- activations ------------------------------------------------------------------------------
def layer_activation_bytes(model: ModelSpec, micro_batch: int, seq_len: int, tp: int = 1,
                           dtype: str = "bf16") -> float:
    """Bytes one device keeps alive for the backward of one layer and one micro-batch (no recompute).

    Saved tensors of a Llama layer with a fused (flash) attention, which stores no s x s scores:
    replicated across the TP group: the layer input, the first norm output, the residual after
    attention and the second norm output (4 tensors of [b, s, h]); split `tp` ways: q and the
    attention output ([b, s, q] each), k and v ([b, s, k] each), and in the SwiGLU MLP the gate
    output, the up output, silu(gate) and the product ([b, s, f] each). Derivation follows
    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), sec. 4.1.
    """
    h, q, k, f = model.hidden_size, q_width(model), kv_width(model), model.intermediate_size
    per_token_elems = 4 * h + (2 * q + 2 * k + 4 * f) / tp
    return micro_batch * seq_len * per_token_elems * dtype_bytes(dtype)


def score_pairs(seq_len: int, window: int | None) -> int:
    """(query, key) score elements per head that the eager attention of runtime/model/attention.py materialises
    for one sequence: s * s without a window (or with one of s or more); with a window w < s, query blocks of
    w rows each against the keys they can reach (block [a, a + w) against keys [a - w + 1, a + w)), so at
    most 2w - 1 keys per query and about s * (2w - 1) in all."""
    if window is None or window >= seq_len:
        return seq_len * seq_len
    total = 0
    for start in range(0, seq_len, window):
        stop = min(seq_len, start + window)
        total += (stop - start) * (stop - max(0, start - window + 1))
    return total


def attention_score_elements(model: ModelSpec, micro_batch: int, seq_len: int, tp: int = 1) -> float:
    """Elements of the attention probabilities one device holds for one layer and micro-batch,
    [b, heads / tp] x `score_pairs` (s x s, or the window's blocks): what a non-fused (eager) attention keeps
    for its backward on top of `layer_activation_bytes` (a fused kernel recomputes them)."""
    return micro_batch * (model.num_heads / tp) * float(score_pairs(seq_len, model.sliding_window))


def layer_input_bytes(model: ModelSpec, micro_batch: int, seq_len: int, dtype: str = "bf16") -> float:
    """Bytes of one layer's input [b, s, h]: what full recompute keeps per layer and micro-batch,
    and what one pipeline stage sends to the next."""
    return micro_batch * seq_len * model.hidden_size * dtype_bytes(dtype)


def logits_bytes(model: ModelSpec, micro_batch: int, seq_len: int, tp: int = 1, dtype: str = "bf16") -> float:
    """Bytes of the logits of one micro-batch on one device of the last stage.

    The [b, s, V/tp] logits in the training dtype, plus the fp32 copy the loss computes its softmax in.
    """
    return micro_batch * seq_len * (model.vocab_size / tp) * (dtype_bytes(dtype) + 4)

"""Bytes the runtime's own step holds per micro-batch, part by part, counted from its operations.

Counted for runtime/model/stage.py as it runs (eager PyTorch, fp32 parameters, autocast in the plan's 16-bit dtype;
semantics/runtime_paths.compute_dtype), per device of a TP group of degree t, for one micro-batch of N = b * s
tokens. Notation: h hidden size; q, k the query and key/value widths and f the MLP width on one device (split t
ways); a the query heads on one device; V the vocabulary rows on one device; c the compute dtype's bytes (2 for
bf16/fp16, 4 for fp32).

Saved for the backward by one decoder layer (`layer_saved_bytes`):
- the fp32 residual stream: the layer input, each RMSNorm's x * rsqrt product and rsqrt statistics, the residual
  after attention (4 * [N, h] + 2 * [N, 1], fp32);
- under autocast, each linear casts its input on its own: the normed input three times (q, k, v) and twice
  (gate, up), [N, h] in c bytes each; in fp32 the q/k/v and gate/up linears share one saved normed input each;
- attention: q and k after rotary, v, the output ([N, q] and [N, kv] in c bytes; kv = q where SDPA and the eager
  path repeat the key/value heads for grouped-query attention, k with flash-attn, which reads them as they are),
  and the softmax statistics (fp32 [N, a]); the eager path keeps instead copies of q, k, v and of the output for its
  matmuls and the probabilities [b, a, s, s] (the window's blocks with a sliding window): c bytes each, on CUDA
  under autocast 4 + c (softmax runs in fp32 there, and its matmul casts the probabilities back);
- the MLP: gate, silu(gate), up and their product ([N, f] in c bytes each);
- under autocast, the c-byte copies of the layer's weight matrices, one set per micro-batch in flight
  (`weight_copy_bytes`: kept by the graph of each forward); with RuntimeOptions.cast_once one set per stage
  instead, made before the step's schedule and freed after it (`stage_weight_copies`,
  runtime/model/working_weights.py), and none per micro-batch.
With activation recompute (torch.utils.checkpoint) a layer keeps only its input; one layer's full set lives again
while it is recomputed inside the backward.

The head (last stage, `head_saved_bytes`): its input and final-norm terms as above, the cast input of the output
projection and its weight copy, and the loss: the whole-vocabulary path keeps the fp32 log-softmax (TP 1) or
softmax (vocabulary-parallel) [N, V], plus the int64 targets. Transients (`*_transient_bytes`): the largest
temporaries above what is saved while one part runs forward or backward, read off the same operations (for
example the loss's backward holds the fp32 [N, V] gradient of the log-softmax and of the loss beside the saved
log-softmax).

tests/test_memory_tracked.py runs the runtime's real step under PyTorch's tensor accounting and holds these
counts to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import flops as model_flops
from ..model.spec import ModelSpec
from ..semantics.runtime_paths import compute_dtype, loss_chunk_tokens

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class PartShape:
    """What sets a part's bytes on one device: the model's widths split over TP degree `tp`, the tokens of one
    micro-batch (`mbs` sequences of `seq` tokens), the compute dtype's bytes `c`, the attention path, whether the
    device is CUDA (autocast's softmax policy differs there), and the loss path."""

    model: ModelSpec
    tp: int
    mbs: int
    seq: int
    dtype: str
    attention: str
    on_cuda: bool
    chunked_loss: bool = False
    loss_chunk: int | None = None  # tokens per chunk of the chunked loss (None: the runtime's rule)
    compiled: bool = False
    cast_once: bool = False  # the layers' weights cast once per step, shared by the micro-batches

    @property
    def chunk(self) -> int:
        """Tokens per chunk of the chunked loss (semantics/runtime_paths.loss_chunk_tokens), at most N."""
        return min(self.tokens, self.loss_chunk or loss_chunk_tokens(max(1, round(self.vocab))))

    @property
    def tokens(self) -> int:
        """N = mbs * seq."""
        return self.mbs * self.seq

    @property
    def c(self) -> int:
        """Bytes per element of the compute dtype."""
        return model_flops.dtype_bytes(compute_dtype(self.dtype))

    @property
    def autocast(self) -> bool:
        """True when matmuls run in a 16-bit dtype over fp32 weights."""
        return compute_dtype(self.dtype) != "fp32"

    @property
    def h(self) -> int:
        return self.model.hidden_size

    @property
    def q(self) -> float:
        return model_flops.q_width(self.model) / self.tp

    @property
    def k(self) -> float:
        return model_flops.kv_width(self.model) / self.tp

    @property
    def f(self) -> float:
        return self.model.intermediate_size / self.tp

    @property
    def heads(self) -> float:
        return self.model.num_heads / self.tp

    @property
    def vocab(self) -> float:
        return self.model.vocab_size / self.tp


def _saved_kv_width(p: PartShape) -> float:
    """Width of the saved keys and values: the query width where the heads are repeated for grouped-query
    attention (SDPA, eager), the key/value width with flash-attn (or without grouping)."""
    grouped = p.model.num_kv_heads < p.model.num_heads
    return p.q if grouped and p.attention != "flash" else p.k


def _block_keys(seq: int, window: int | None) -> int:
    """Keys the blocks of a windowed attention read, summed over its query blocks (runtime/model/attention.py: block
    [a, a + w) reads keys [a - w + 1, a + w)); s without a window (one block of every key)."""
    if window is None or window >= seq:
        return seq
    return sum(min(seq, start + window) - max(0, start - window + 1) for start in range(0, seq, window))


def _windowed(p: PartShape) -> bool:
    window = p.model.sliding_window
    return window is not None and window < p.seq


def attention_saved_bytes(p: PartShape) -> float:
    """Bytes the attention core keeps per micro-batch: q, k, v, output and statistics or probabilities."""
    n, c = p.tokens, p.c
    kv = _saved_kv_width(p)
    if p.attention == "eager":
        per_score = FP32 + c if (p.on_cuda and p.autocast) else c
        scores = p.mbs * p.heads * float(model_flops.score_pairs(p.seq, p.model.sliding_window))
        keys = p.mbs * float(_block_keys(p.seq, p.model.sliding_window))  # each block's matmuls copy its keys
        return n * c * 2 * p.q + keys * c * 2 * kv + scores * per_score
    saved = n * c * (2 * p.q + 2 * kv) + n * FP32 * p.heads  # q, k, v, output, log-sum-exp
    if _windowed(p):  # one SDPA per block of queries: their outputs and the concatenated output; block masks
        window = p.model.sliding_window or p.seq
        saved += n * c * p.q + model_flops.score_pairs(p.seq, window)
    return saved


def compiled_layer(p: PartShape) -> bool:
    """True when the layer runs as one compiled graph whose saved tensors `layer_saved_bytes` counts as such:
    torch.compile at TP 1 with SDPA or flash-attn and no sliding window. Elsewhere (graph breaks at TP
    collectives, the eager attention path, windowed blocks) the eager count stands, an upper bound."""
    return p.compiled and p.tp == 1 and p.attention != "eager" and not _windowed(p)


def layer_saved_bytes(p: PartShape) -> float:
    """Bytes one decoder layer keeps for its backward per micro-batch (its input included, its weight copies not:
    `weight_copy_bytes`), without recompute.

    Compiled (`compiled_layer`): torch.compile's partition recomputes the norms' products and the MLP's product
    in the backward and keeps, besides the input and the two rsqrt statistics, the normed inputs once each and the
    attention output in the compute dtype (3 x [N, h]; in fp32 the residual too), q, k, v, the output and the
    log-sum-exp as eager, and three of the MLP's four [N, f] tensors (tests/test_cost_activations.py reads this
    off inductor's graph on CPU)."""
    n, h, c = p.tokens, p.h, p.c
    if compiled_layer(p):
        kv = _saved_kv_width(p)
        attention = n * c * (2 * p.q + 2 * kv) + n * FP32 * p.heads
        normed = 3 * n * h * (c if p.autocast else FP32)
        return n * h * FP32 + 2 * n * FP32 + normed + attention + 3 * n * p.f * c
    stream = n * (4 * h * FP32 + 2 * FP32)  # input, x*rsqrt twice, residual; two rsqrt
    casts = n * h * c * (5 if p.autocast else 2)  # normed inputs as the linears keep them
    mlp = 4 * n * p.f * c
    return stream + casts + attention_saved_bytes(p) + mlp


def weight_copy_bytes(p: PartShape, matmul_params: float) -> float:
    """Bytes of the autocast copies of `matmul_params` weight elements (0 in fp32)."""
    return matmul_params * p.c if p.autocast else 0.0


def layer_weight_copies(p: PartShape) -> float:
    """Autocast weight copies of one layer on one device, kept per micro-batch in flight (none with cast_once:
    `stage_weight_copies`)."""
    return 0.0 if p.cast_once else weight_copy_bytes(p, model_flops.layer_matmul_params(p.model) / p.tp)


def stage_weight_copies(p: PartShape, num_layers: int) -> float:
    """With cast_once under autocast: the one set of 16-bit copies of the stage's `num_layers` layers' matmul
    weights, held from the start of the step's schedule to its end, whatever the micro-batches in flight."""
    if not p.cast_once:
        return 0.0
    return num_layers * weight_copy_bytes(p, model_flops.layer_matmul_params(p.model) / p.tp)


def recompute_saved_bytes(p: PartShape) -> float:
    """What one checkpointed layer keeps per micro-batch: its input [N, h] fp32."""
    return p.tokens * p.h * FP32


def layer_forward_transient_bytes(p: PartShape) -> float:
    """Largest temporaries of one layer's forward above what it finally keeps: its first RMSNorm's input
    square (fp32), or under autocast the normed input before the q projection casts it."""
    return p.tokens * p.h * (p.c if p.autocast else FP32)


def layer_backward_transient_bytes(p: PartShape, accumulating: bool = False, copy_kept: bool = True) -> float:
    """Largest temporaries of one layer's backward above its saved tensors, its incoming [N, h] fp32 gradient
    included, read off the backward of the MLP's down projection and product where it starts.

    Under autocast, at its start: the incoming gradient cast to the compute dtype and the gradients of the
    product [N, f] and of the down projection's weight (compute dtype); a moment later, the projection's saved
    input and weight copy released, the product's gradient beside its two input gradients [N, f] and, where no
    gradient existed yet (the step's first backward), the weight's fp32 gradient, now the parameter's. In fp32:
    the product's gradient and its two input gradients, the first time with the weight's gradient beside them,
    or at the start the product's and the weight's gradients. With cast_once the weight copy is the stage's
    (`stage_weight_copies`): it stays, so nothing of it is released here; and between those two moments the
    weight's gradient is cast to fp32 (runtime/model/working_weights._SharedCast.backward): its c-byte gradient
    beside its fp32 cast (h * f * (c + 4) bytes), the product's [N, f] gradient in place of the product (its
    saved input, released), the copy itself released where no later backward multiplies by it (`copy_kept`
    False: the step's last backward without recompute; h * f * c bytes less)."""
    n, h, c = p.tokens, p.h, p.c
    incoming = n * h * FP32
    down_weight = h * p.f
    first_time = 0.0 if accumulating else down_weight * FP32
    if p.autocast:
        start = n * h * c + n * p.f * c + down_weight * c
        later = 2 * n * p.f * c - (0.0 if p.cast_once else down_weight * c) + first_time
        if p.cast_once:
            later = max(later, down_weight * (FP32 + (c if copy_kept else 0.0)))
    else:
        start = n * p.f * FP32 + down_weight * FP32
        later = 2 * n * p.f * FP32 + first_time
    return incoming + max(start, later)


def head_saved_bytes(p: PartShape) -> float:
    """Bytes the last stage's head keeps per micro-batch: its input and norm terms, and
    - the whole-vocabulary loss: the cast input of the output projection (its weight copy:
      `head_weight_copies`), the fp32 log-softmax (TP 1) or softmax (vocabulary-parallel) [N, V] and the int64
      targets;
    - the chunked loss (runtime/model/chunked_loss.py): the fp32 gradients it computed in the forward, of its input
      [N, h] and of the projection's weight [V, h]."""
    n, h, c = p.tokens, p.h, p.c
    stream = n * (2 * h * FP32 + FP32)  # input, x*rsqrt; rsqrt
    if p.chunked_loss:
        return stream + n * h * FP32 + p.vocab * h * FP32
    cast = n * h * (c if p.autocast else FP32)
    loss = n * p.vocab * FP32  # log-softmax (TP 1) or softmax (vocabulary-parallel)
    if p.tp > 1:
        loss += n * (INT64 + 1)  # local targets and their out-of-shard mask
    return stream + cast + n * INT64 + loss


def head_weight_copies(p: PartShape) -> float:
    """Autocast copy of the output projection on one device, kept per micro-batch in flight (the chunked loss
    drops its copy when its forward ends: `head_forward_transient_bytes`)."""
    return 0.0 if p.chunked_loss else weight_copy_bytes(p, p.vocab * p.h)


def head_forward_transient_bytes(p: PartShape) -> float:
    """Largest temporaries above the saved tensors in the head's forward.

    Whole-vocabulary loss: the fp32 normed input (alive until the head returns; under autocast it is not saved),
    the logits in the compute dtype and their fp32 copy (vocabulary-parallel also the shifted logits), the
    per-token losses. Chunked loss: the fp32 normed input, the targets' copy, the weight's autocast copy, and one
    chunk of n tokens at its largest: its cast input [n, h] beside two fp32 [n, V] while the sums of exponentials
    are taken, or (under autocast) the softmax's gradient [n, V] beside its products with the weight [n, h]
    and with the input [V, h] in the compute dtype (on CUDA none: cuBLAS writes them into the fp32 sums)."""
    n, h, c = p.tokens, p.h, p.c
    nv = n * p.vocab
    if p.chunked_loss:
        k, v = p.chunk, p.vocab
        if p.autocast and p.on_cuda:  # the gradient products go straight into their fp32 sums (out_dtype)
            chunk = max(k * h * c + 2 * k * v * FP32, c * k * v)
            return n * h * FP32 + n * INT64 + v * h * c + chunk
        if p.autocast:
            chunk = max(k * h * c + 2 * k * v * FP32, c * (k * v + k * h + v * h))
            return n * h * FP32 + n * INT64 + v * h * c + chunk
        return n * h * FP32 + n * INT64 + 2 * k * v * FP32
    normed = n * (h if p.autocast else 0) * FP32 + n * FP32
    logits = nv * (c + FP32) if p.autocast else nv * FP32
    return normed + logits + (nv * FP32 if p.tp > 1 else 0.0)


def head_backward_transient_bytes(p: PartShape, accumulating: bool = False) -> float:
    """Largest temporaries above the saved tensors in the head's backward.

    Whole-vocabulary loss: first the fp32 [N, V] gradients of the loss and of the (log-)softmax beside the saved
    one; then, those released, the logits' gradient in the compute dtype beside the projection's weight
    gradient in fp32. Chunked loss: its two gradients are returned as they are; the final norm's backward then
    holds three fp32 [N, h] (less the weight gradient's [V, h] where it was added to an existing one and
    freed)."""
    if p.chunked_loss:
        norm = 3 * p.tokens * p.h * FP32
        return max(0.0, norm - p.vocab * p.h * FP32) if accumulating else norm
    nv = p.tokens * p.vocab
    return max(2 * nv * FP32, nv * (p.c if p.autocast else FP32) + p.vocab * p.h * FP32)


def embedding_saved_bytes(p: PartShape) -> float:
    """Bytes the first stage's embedding keeps per micro-batch beyond its output (the first layer's input):
    vocabulary-parallel, the shifted token ids and their out-of-shard mask."""
    return p.tokens * (INT64 + 1) if p.tp > 1 else 0.0


def embedding_backward_transient_bytes(p: PartShape) -> float:
    """The embedding's backward builds a dense fp32 gradient of its whole [V, h] shard, beside the incoming
    [N, h] fp32 gradient of its output."""
    return p.vocab * p.h * FP32 + p.tokens * p.h * FP32

"""What one micro-batch costs a part besides its matrix products: bytes the other operations move, operations
the host dispatches and kernels the device launches, forward and backward, for the runtime's paths.

Counted on the runtime's own modules (runtime/model/stage.py) with a dispatch-mode tracer (scripts/count_traffic.py):
every aten operation of a part's forward and backward, the bytes of the tensors each operation other than a
view, a matrix product or the fused attention reads and writes, the operations dispatched (views included: each
costs the host a dispatch) and those that run a kernel. The byte counts are linear in the widths per token, fitted
over ten shapes and checked on three others to 0.7% (`tests/test_cost_traffic.py` re-counts two shapes), with
N tokens of the micro-batch, h hidden, q the query width, k the key/value width (kx: the width saved after
grouped-query heads are repeated), f the MLP width, V vocabulary rows and W the layer's matrix weights on one
device, c the compute dtype's bytes:

  layer, eager, 16-bit forward   104 Nh + 45 Nq + 31 Nk + 3 N(q + k)[grouped] + 10 Nf + 6 W
                        backward 304 Nh + 59 Nq + 52 Nk + 3 N(q + k)[grouped] + 18 Nf + 18 W
  layer, eager, fp32   forward    78 Nh + 53 Nq + 31 Nk + 7 N(q + k)[grouped] + 20 Nf
                        backward 262 Nh + 61 Nq + 54 Nk + 7 N(q + k)[grouped] + 36 Nf + 12 W
  head, whole-vocabulary loss     forward 34 (28) Nh + 18 (12) NV + 6 (0) Vh; backward 114 (108) Nh + 26 (20) NV
                                  + 18 (12) Vh  (16-bit, fp32 in brackets)
  head, chunked loss (n chunks)   forward 44 (32) Nh + 64 (56) NV + 6 (0) Vh + 10 (8) Vh per chunk;
                                  backward 116 Nh + 20 Vh
  embedding                       forward 8 Nh; backward 4 Nh + 16 Vh (its dense [V, h] gradient)
The W and Vh terms are per micro-batch (autocast's weight copies, the weight gradients' cast and accumulation),
the rest per token. With RuntimeOptions.cast_once the layer's weight cast, (4 + c) W of the forward's 16-bit W
term and one kernel per matrix (`layer_weight_cast`), runs once per step instead (cost/estimate.py charges it).
Operations per micro-batch: layer 92 / 162 (16-bit; 84 / 156 without grouped-query heads), 78 / 142 (fp32;
70 / 136); kernels 50 / 97 (48 / 95), 36 / 77 (34 / 75); head 22 / 36 (fp32 19 / 33), chunked 15 + 43 per chunk
(14 + 38) / 23; embedding 2 / 2.

Compiled layers (torch.compile, RuntimeOptions.compile; TP 1): the elementwise operations fuse around the matrix
products, so a layer's forward reads its input and weights and writes what it keeps for the backward and its
output, and its backward reads those and writes the gradients: bytes = the compiled saved bytes (cost/
activations.py) + 2 x [N, h] fp32 + 6 W forward, twice the saved bytes + 2 x [N, h] + 18 W backward; 12 / 25
kernels launched by one compiled call each way. An estimate from the graph's structure, not yet checked on a GPU.

Matrix products' operands (`matmul_operand_bytes`): each product Y = X W^T reads X and W and writes Y; the backward
touches each of the three twice (dX = dY W, dW = dY^T X). Per micro-batch, forward: c (N (7h + 2q + 2k + 3f) + W)
for a layer's seven products, c (N h + N V + V h) for the head; backward twice that. The chunked loss runs three
products per chunk in its forward (two in fp32, where the weight gradient accumulates in place with addmm_, counted
with the other bytes), reading the head's weights once per chunk. `tests/test_cost_traffic.py` checks these counts
too. Only an emulated CPU device pays for them (cost/compute.py): one thread streams a product's operands from
memory between its arithmetic, while a GPU loads them inside a compute-bound kernel.

Tensor parallelism splits q, k, f and V (and W) over the group; the replicated [N, h] work is done by every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model import flops as model_flops
from ..semantics.runtime_paths import loss_chunk_tokens
from .activations import FP32, PartShape, compiled_layer, layer_saved_bytes, weight_copy_bytes


@dataclass(frozen=True)
class PassCost:
    """One pass (forward or backward) of a part for one micro-batch on one device: matrix-product FLOPs,
    attention FLOPs (the fused score and value products), bytes the other operations move, operations the host
    dispatches, kernels the device runs."""

    matmul_flops: float
    attention_flops: float
    bytes: float
    ops: float
    kernels: float
    matmul_bytes: float = 0.0  # the matrix products' operands read and results written (`matmul_operand_bytes`)

    def plus(self, other: PassCost) -> PassCost:
        """Both passes' costs added (the backward of a recomputed layer runs its forward again)."""
        return PassCost(self.matmul_flops + other.matmul_flops, self.attention_flops + other.attention_flops,
                        self.bytes + other.bytes, self.ops + other.ops, self.kernels + other.kernels,
                        self.matmul_bytes + other.matmul_bytes)


@dataclass(frozen=True)
class PartTraffic:
    """A part's forward and backward for one micro-batch (`PassCost` each)."""

    fwd: PassCost
    bwd: PassCost


def _grouped(p: PartShape) -> bool:
    return p.model.num_kv_heads < p.model.num_heads


def layer_weight_cast(p: PartShape) -> PassCost:
    """Casting one decoder layer's seven matrices to the compute dtype on one device under autocast (nothing in
    fp32): reading the fp32 weights and writing the c-byte copies, (4 + c) W bytes, one operation and one kernel
    each. In every micro-batch's forward, or once per step with cast_once (`layer_traffic` leaves it out)."""
    if not p.autocast:
        return PassCost(0.0, 0.0, 0.0, 0.0, 0.0)
    weights = model_flops.layer_matmul_params(p.model) / p.tp
    return PassCost(0.0, 0.0, (FP32 + p.c) * weights, 7.0, 7.0)


def layer_traffic(p: PartShape, recompute: bool = False) -> PartTraffic:
    """One decoder layer (module docstring); with `recompute` its backward runs the forward again. With
    cast_once the forward multiplies by the step's working copies: no cast (`layer_weight_cast`), a view of the
    copy in its place (an operation, no kernel); the copies are read as autocast's are."""
    n, h, q, k, f = p.tokens, p.h, p.q, p.k, p.f
    weights = model_flops.layer_matmul_params(p.model) / p.tp
    matmul = 2.0 * n * weights
    attention = 4.0 * n * model_flops.attended_keys(p.model, p.seq) * q
    if p.attention == "eager":  # batched matrix products and a softmax, not a fused kernel
        matmul, attention = matmul + attention, 0.0
    # the seven products' inputs (q, k, v, gate, up: [N, h]; o: [N, q]; down: [N, f]) and outputs per token
    operands = matmul_operand_bytes(n, 5 * h + q + f, q + 2 * k + 2 * f + 2 * h, weights, p.c)
    grouped = 1.0 if _grouped(p) else 0.0
    if compiled_layer(p):
        saved = layer_saved_bytes(p) + weight_copy_bytes(p, weights)
        boundary = 2 * n * h * FP32
        fwd = PassCost(matmul, attention, saved + boundary + 6 * weights, 2.0, 12.0, operands)
        bwd = PassCost(2 * matmul, 2 * attention, 2 * saved + boundary + 18 * weights, 2.0, 25.0, 2 * operands)
    elif p.autocast:
        fwd = PassCost(matmul, attention, n * (104 * h + 45 * q + 31 * k + 3 * grouped * (q + k) + 10 * f)
                       + 6 * weights, 84 + 8 * grouped, 48 + 2 * grouped, operands)
        bwd = PassCost(2 * matmul, 2 * attention, n * (304 * h + 59 * q + 52 * k + 3 * grouped * (q + k) + 18 * f)
                       + 18 * weights, 156 + 6 * grouped, 95 + 2 * grouped, 2 * operands)
    else:
        fwd = PassCost(matmul, attention, n * (78 * h + 53 * q + 31 * k + 7 * grouped * (q + k) + 20 * f),
                       70 + 8 * grouped, 34 + 2 * grouped, operands)
        bwd = PassCost(2 * matmul, 2 * attention, n * (262 * h + 61 * q + 54 * k + 7 * grouped * (q + k) + 36 * f)
                       + 12 * weights, 136 + 6 * grouped, 75 + 2 * grouped, 2 * operands)
    if p.cast_once and p.autocast:
        cast = layer_weight_cast(p)
        fwd = PassCost(fwd.matmul_flops, fwd.attention_flops, fwd.bytes - cast.bytes, fwd.ops,
                       fwd.kernels - (0.0 if compiled_layer(p) else cast.kernels), fwd.matmul_bytes)
    return PartTraffic(fwd, fwd.plus(bwd) if recompute else bwd)


def matmul_operand_bytes(tokens: float, inputs: float, outputs: float, weights: float, c: int) -> float:
    """Bytes the forward matrix products Y = X W^T of one micro-batch read and write: X ([tokens, inputs] summed
    over the products), the weights (`weights` elements) and Y ([tokens, outputs]), `c` bytes each. The backward
    touches each twice (dX = dY W reads dY and W and writes dX; dW = dY^T X reads dY and X and writes dW)."""
    return c * (tokens * (inputs + outputs) + weights)


def head_traffic(p: PartShape) -> PartTraffic:
    """The last stage's final norm, output projection and loss (module docstring)."""
    n, h, v = p.tokens, p.h, p.vocab
    matmul = 2.0 * n * h * v
    half = p.autocast
    if p.chunked_loss:
        chunks = math.ceil(n / p.chunk) if p.chunk else 1
        fwd_bytes = n * h * (44 if half else 32) + n * v * (64 if half else 56) + v * h * (6 if half else 0) \
            + chunks * v * h * (10 if half else 8)
        # each chunk's logits product and its backward's two, run inside the forward; in fp32 the weight
        # gradient's product accumulates in place (addmm_), counted with the other operations' bytes above
        products = 3 if half else 2
        operands = products * (matmul_operand_bytes(n, h, v, 0.0, p.c) + chunks * v * h * p.c)
        fwd = PassCost(3 * matmul, 0.0, fwd_bytes, (15 if half else 14) + (43 if half else 38) * chunks,
                       (10 + 30 * chunks) if half else (9 + 26 * chunks), operands)
        bwd = PassCost(0.0, 0.0, 116 * n * h + 20 * v * h, 23, 14)
        return PartTraffic(fwd, bwd)
    operands = matmul_operand_bytes(n, h, v, v * h, p.c)
    fwd = PassCost(matmul, 0.0, n * h * (34 if half else 28) + n * v * (18 if half else 12) + v * h * (6 if half else 0),
                   22 if half else 19, 14 if half else 11, operands)
    bwd = PassCost(2 * matmul, 0.0, n * h * (114 if half else 108) + n * v * (26 if half else 20)
                   + v * h * (18 if half else 12), 36 if half else 33, 24 if half else 21, 2 * operands)
    return PartTraffic(fwd, bwd)


def embedding_traffic(p: PartShape) -> PartTraffic:
    """The first stage's embedding lookup and its dense gradient (module docstring)."""
    n, h, v = p.tokens, p.h, p.vocab
    return PartTraffic(PassCost(0.0, 0.0, 8 * n * h, 2, 1), PassCost(0.0, 0.0, 4 * n * h + 16 * v * h, 2, 2))


# Bytes one optimizer step moves per parameter: the gradient norm (read) and clipping (read, write) of fp32
# gradients, 12, plus AdamW: fused, one pass reading parameter, gradient and both moments and writing parameter
# and moments (28); multi-tensor, eight passes (decay, the first moment's lerp, the second's scale and addcmul,
# its square root, the bias correction and epsilon, the update: 80).
OPTIMIZER_BYTES_PER_PARAM = {"fused": 12.0 + 28.0, "foreach": 12.0 + 80.0}


def loss_chunks(p: PartShape) -> int:
    """Chunks of the chunked loss for one micro-batch (semantics/runtime_paths.loss_chunk_tokens)."""
    return math.ceil(p.tokens / (p.chunk or loss_chunk_tokens(int(p.vocab))))

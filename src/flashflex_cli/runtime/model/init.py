"""Deterministic initial weights, independent of the plan: every parameter is defined as a FULL tensor drawn on
the CPU from a generator seeded by sha256(seed, global parameter name), then sliced to a rank's shard. So the same
seed gives the same model whatever the pipeline, stage and TP layout (and whatever the device).

`shard_init` produces a rank's slice bit-identical to `full_init(...)` sliced, without building the full tensor:
peak memory is the shard plus one block of BLOCK_ELEMENTS values (see `_normal_slice` for why that is exact).

Scheme (GPT-2 / Llama practice): normal(0, 0.02) for embeddings, projections and the head; the residual
output projections (attn.wo, mlp.w_down) scaled by 1/sqrt(2 * num_layers); norm weights are ones; q/k/v
biases (Qwen2) are zeros. A tied model has no "head": its output projection is "embed", drawn once.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch

from ...model.spec import ModelSpec

INIT_STD = 0.02
BLOCK_ELEMENTS = 1 << 18  # values drawn per block by shard_init (1 MiB of fp32); a multiple of 16
BIASES = ("attn.bq", "attn.bk", "attn.bv")


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed derived from the run seed and a global parameter name."""
    digest = hashlib.sha256(f"flashflex:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _std(spec: ModelSpec, name: str) -> float:
    """Standard deviation of a normally drawn parameter."""
    if name.endswith(("attn.wo", "mlp.w_down")):
        return INIT_STD / math.sqrt(2 * spec.num_layers)
    return INIT_STD


def full_init(spec: ModelSpec, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 CPU tensor of global parameter `name` (shape `shape`) for run seed `seed`."""
    if name.endswith("norm"):
        return torch.ones(shape, dtype=torch.float32)
    if name.endswith(BIASES):
        return torch.zeros(shape, dtype=torch.float32)
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    return torch.randn(shape, generator=generator, dtype=torch.float32) * _std(spec, name)


def shard_init(spec: ModelSpec, name: str, shape: tuple[int, ...], seed: int, dim: int | None, start: int,
               stop: int, block: int = BLOCK_ELEMENTS, out: torch.Tensor | None = None) -> torch.Tensor:
    """`full_init(spec, name, shape, seed)` narrowed to [start, stop) along `dim` (dim None: the whole tensor),
    bit-identical, drawn `block` values at a time (block: a multiple of 16). Written into `out` when given (a
    tensor of the slice's shape, e.g. the parameter itself: a contiguous fp32 CPU one is filled directly, so no
    second copy of the shard exists), else into a new contiguous fp32 CPU tensor; returns it."""
    if dim is None or name.endswith(("norm", *BIASES)):
        full = full_init(spec, name, shape, seed)
        piece = full if dim is None else full.narrow(dim, start, stop - start).contiguous()
        return piece if out is None else out.copy_(piece)
    if not block_draw_is_exact():  # another torch fills randn differently: draw in full, slice
        piece = full_init(spec, name, shape, seed).narrow(dim, start, stop - start)
        return piece.contiguous() if out is None else out.copy_(piece)
    generator = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
    direct = out is not None and out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
    piece = _normal_slice(shape, dim, start, stop, generator, block, out if direct else None).mul_(_std(spec, name))
    return piece if out is None or direct else out.copy_(piece)


@functools.lru_cache(maxsize=1)
def block_draw_is_exact() -> bool:
    """Whether this torch's CPU randn fills the way `_normal_slice` relies on (checked once per process on a
    small tensor with a ragged tail, sliced along each dimension: a few thousand values)."""
    shape = (37, 53)
    for dim, (start, stop) in ((0, (5, 29)), (1, (17, 40))):
        full = torch.randn(shape, generator=torch.Generator(device="cpu").manual_seed(7))
        part = _normal_slice(shape, dim, start, stop, torch.Generator(device="cpu").manual_seed(7), 64)
        if not torch.equal(full.narrow(dim, start, stop - start), part):
            return False
    return True


def _normal_slice(shape: tuple[int, ...], dim: int, start: int, stop: int, generator: torch.Generator,
                  block: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.randn(shape, generator=generator) narrowed to [start, stop) along `dim`, drawn block by block.

    Exact because of how the CPU kernel fills an fp32 tensor of n >= 16 values (aten/src/ATen/native/cpu/
    DistributionTemplates.h, normal_fill): it draws n uniforms, one 32-bit generator output each (what
    torch.rand draws per fp32 value), turns each aligned group of 16 into 16 normals by Box-Muller, and when
    n % 16 != 0 draws 16 more uniforms and overwrites the last 16 values with their normals. So aligned groups
    of 16 can be drawn by torch.randn on a block at the same generator position; positions before the shard
    are skipped with torch.rand; tests/test_memory_bounds.py checks bit-equality against the full draw.
    """
    n = math.prod(shape)
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    span = shape[dim] * inner  # flat values per index of the dimensions before `dim`
    local = list(shape)
    local[dim] = stop - start
    if out is None:
        out = torch.empty(local, dtype=torch.float32)
    if list(out.shape) != local or out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 CPU tensor of shape {local}")
    if n < 16 or block % 16:
        return out.copy_(torch.randn(shape, generator=generator).narrow(dim, start, stop - start))
    if out.numel() == 0:
        return out
    flat = out.view(outer, (stop - start) * inner)
    first, last = start * inner, (outer - 1) * span + stop * inner  # flat range [first, last) holds the shard
    body = n - n % 16
    pos = 0
    scratch = torch.empty(block, dtype=torch.float32)

    def skip_to(target: int) -> None:
        nonlocal pos
        while pos < target:
            count = min(block, target - pos)
            torch.rand(count, generator=generator, out=scratch[:count])
            pos += count

    skip_to(min(first, body) // 16 * 16)
    while pos < min(last, body):
        count = min(block, body - pos)
        _place(flat, torch.randn(count, generator=generator), pos, span, inner, start, stop)
        pos += count
    if n % 16 and last > n - 16:
        skip_to(n)
        _place(flat, torch.randn(16, generator=generator), n - 16, span, inner, start, stop)
    return out


def _place(flat: torch.Tensor, values: torch.Tensor, pos: int, span: int, inner: int, start: int,
           stop: int) -> None:
    """Copy the full tensor's flat values [pos, pos + len(values)) that lie in the shard into `flat`
    ([outer, (stop - start) * inner], the shard with the dimensions before and from the split one merged)."""
    end = pos + values.numel()
    for o in range(pos // span, (end - 1) // span + 1):
        base = o * span + start * inner
        lo, hi = max(pos, base), min(end, o * span + stop * inner)
        if lo < hi:
            flat[o, lo - base:hi - base] = values[lo - pos:hi - pos]

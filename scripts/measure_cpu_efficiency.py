"""Measure `measured_compute_efficiency` on this machine: a Llama layer's achieved FLOP/s on the CPU
over the dense matmul rate that `flashflex profile` records for a CPU device.

Times an n x n fp32 matmul (best of several runs), then forward + backward of one Llama layer (RMSNorm,
GQA attention via scaled_dot_product_attention, SwiGLU) built from torch.nn.functional, and divides the
layer's FLOPs (flashflex_cli.model.flops) by its time and by the matmul rate. One thread, like one
emulated device. Run: OMP_NUM_THREADS=1 .venv/bin/python scripts/measure_cpu_efficiency.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as tf

from flashflex_cli.model.flops import layer_fwd_flops
from flashflex_cli.model.spec import PRESETS, ModelSpec

REPEATS = 7


def once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def matmul_fn(n: int = 1024):
    a, b = torch.randn(n, n), torch.randn(n, n)
    return lambda: a @ b, 2 * n**3


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def layer_fn(model: ModelSpec, batch: int, seq: int):
    h, heads, kv, d, f = (model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim,
                          model.intermediate_size)
    g = torch.Generator().manual_seed(0)

    def p(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).requires_grad_()

    wq, wk, wv, wo = p(h, h), p(kv * d, h), p(kv * d, h), p(h, h)
    w1, w3, w2 = p(f, h), p(f, h), p(h, f)
    n1, n2 = torch.ones(h, requires_grad=True), torch.ones(h, requires_grad=True)
    x = torch.randn(batch, seq, h, requires_grad=True)

    def step() -> None:
        a = rms(x, n1)
        q = tf.linear(a, wq).view(batch, seq, heads, d).transpose(1, 2)
        k = tf.linear(a, wk).view(batch, seq, kv, d).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
        v = tf.linear(a, wv).view(batch, seq, kv, d).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
        o = tf.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, h)
        y = x + tf.linear(o, wo)
        b = rms(y, n2)
        out = y + tf.linear(tf.silu(tf.linear(b, w1)) * tf.linear(b, w3), w2)
        out.sum().backward()

    return step


def main() -> None:
    """Interleave matmul and layer timings (best of many) so that load from other processes hits both."""
    torch.set_num_threads(1)
    matmul, matmul_flops = matmul_fn()
    ratios = []
    for name in ("llama-small", "llama-100m"):
        model = PRESETS[name]
        for batch, seq in ((1, 256), (2, 256), (1, 512)):
            step = layer_fn(model, batch, seq)
            step(), matmul()
            best_mm, best_layer = float("inf"), float("inf")
            for _ in range(REPEATS):
                best_mm = min(best_mm, once(matmul))
                best_layer = min(best_layer, once(step))
            rate = matmul_flops / best_mm
            eff = 3 * layer_fwd_flops(model, batch, seq) / best_layer / rate
            ratios.append(eff)
            print(f"{name:12s} b={batch} s={seq}: matmul {rate / 1e9:6.1f} GFLOP/s, layer "
                  f"{best_layer * 1e3:7.1f} ms fwd+bwd, efficiency {eff:.3f}")
    print(f"median efficiency: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()

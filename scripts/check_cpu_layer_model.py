"""Check the analytic model of an emulated CPU device against the runtime's own layers on this machine.

Probes this host as `flashflex profile` does (one thread pinned to one core: an fp32 n x n matmul rate and a copy's
memory bandwidth). Times the fused causal attention alone at each shape's heads and head size and prints its
FLOP/s as a fraction of the matmul rate (the model's `cpu_attention_efficiency`). Then times forward and backward
of a chain of the runtime's decoder layers (runtime/model.StageModule, eager, fp32, SDPA) for three shapes at
micro-batches 1 to 8 (sequence 128) in the same pinned thread, and prints beside each the cost model's layer times
(cost/compute.layer_times) for a one-device cluster of the probed figures and their ratio; last, the element-wise
bytes' rate and the per-operation time (`cpu_op_seconds`) that would fit these passes best, everything else as
modelled, and the error with them. A chain of layers, not one layer timed alone: in a stage each product's weights
and inputs were evicted from the caches by the layers between its uses, as they are here.

Run: .venv/bin/python scripts/check_cpu_layer_model.py  (about 2 minutes on one core)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashflex_cli.cost.activations import PartShape
from flashflex_cli.cost.compute import layer_times
from flashflex_cli.cost.params import CostParams
from flashflex_cli.cost.traffic import layer_traffic
from flashflex_cli.hardware.cluster import Cluster
from flashflex_cli.hardware.cpu_share import as_emulated_device
from flashflex_cli.hardware.probe_local import (
    FULL_CPU,
    DeviceProbe,
    NodeProbe,
    host_memory_bytes,
    matmul_flops,
    memory_bandwidth,
    node_from_probe,
)
from flashflex_cli.model.spec import PRESETS, ModelSpec
from flashflex_cli.plan.schema import TrainConfig
from flashflex_cli.runtime.model.attention import SDPA
from flashflex_cli.runtime.model.stage import StageModule
from flashflex_cli.runtime.model.tensor_parallel import TPContext

SEQ = 128
SHAPES = ("llama-tiny", "llama-small", "llama-100m")
MICRO_BATCHES = (1, 2, 4, 8)
CHAIN = 4  # layers timed together
REPEATS = 7


def median_passes(forward_pass: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """(forward, backward) thread CPU seconds of `forward_pass()` and the backward of its output (all ones as the
    gradient): medians over REPEATS after two warm-up runs."""
    forward, backward = [], []
    for i in range(REPEATS + 2):
        start = time.thread_time()
        out = forward_pass()
        middle = time.thread_time()
        out.backward(torch.ones_like(out))
        end = time.thread_time()
        if i >= 2:
            forward.append(middle - start)
            backward.append(end - middle)
    return statistics.median(forward), statistics.median(backward)


def measured_layer(spec: ModelSpec, mbs: int) -> tuple[float, float]:
    """(forward, backward) seconds of one layer: those of a CHAIN-layer stage, divided."""
    torch.manual_seed(0)
    stage = StageModule(spec, (0, CHAIN), False, False, TPContext(None), SDPA, chunked_loss=True)
    x = torch.randn(mbs, SEQ, spec.hidden_size, requires_grad=True)
    forward, backward = median_passes(lambda: stage(x))
    return forward / CHAIN, backward / CHAIN


def attention_efficiency(spec: ModelSpec, seq: int, rate: float) -> tuple[float, float]:
    """(forward, backward) FLOP/s of the fused causal attention (scaled_dot_product_attention) at the model's heads
    and head size, sequence `seq`, one sequence, as fractions of the matmul `rate`; the FLOPs counted as the cost
    model counts them (4 x pairs x head size forward, twice that backward)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, spec.num_heads, seq, spec.head_dim, requires_grad=True) for _ in range(3))
    forward, backward = median_passes(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    flops = 4.0 * spec.num_heads * seq * (seq + 1) / 2 * spec.head_dim
    return flops / forward / rate, 2 * flops / backward / rate


@dataclass(frozen=True)
class Pass:
    """One timed pass: measured and modelled seconds, the bytes its element-wise operations move and its
    operations, as cost/traffic.py counts them."""

    measured: float
    model: float
    bytes: float
    ops: float


def refit_bytes_and_ops(rows: list[Pass], bandwidth: float, params: CostParams) -> tuple[float, float, list[float]]:
    """The element-wise bytes' rate (as a multiple of the probe's copy `bandwidth`) and the per-operation seconds
    that fit the passes best, everything else as modelled (least squares on relative error, two unknowns), and
    each pass's error with them."""
    rest = [r.model - r.bytes / (bandwidth * params.memory_bandwidth_efficiency) - r.ops * params.cpu_op_seconds
            for r in rows]
    a = [(r.bytes / bandwidth / r.measured, r.ops / r.measured, (r.measured - x) / r.measured)
         for r, x in zip(rows, rest, strict=True)]
    s11, s12, s22 = sum(u * u for u, _, _ in a), sum(u * v for u, v, _ in a), sum(v * v for _, v, _ in a)
    b1, b2 = sum(u * y for u, _, y in a), sum(v * y for _, v, y in a)
    det = s11 * s22 - s12 * s12
    inverse_factor, per_op = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
    errors = [abs((x + r.bytes / bandwidth * inverse_factor + r.ops * per_op) / r.measured - 1)
              for r, x in zip(rows, rest, strict=True)]
    return 1.0 / inverse_factor, per_op, errors


def this_host(rate: float, bandwidth: float) -> Cluster:
    """A one-device cluster of this host's probed figures, written as `flashflex profile` writes them."""
    probe = DeviceProbe(0, "cpu", "fp32", rate, host_memory_bytes(), bandwidth)
    return Cluster(name="this-host", nodes=[node_from_probe(NodeProbe("host", "cpu", [probe]), node_name="host")])


def main() -> None:
    torch.set_num_threads(1)
    params = CostParams()
    rows: list[Pass] = []
    with as_emulated_device(0):
        rate = matmul_flops(torch.device("cpu"), torch.float32, FULL_CPU.matmul_n, FULL_CPU.repeats)
        bandwidth = memory_bandwidth(torch.device("cpu"), FULL_CPU.copy_bytes, FULL_CPU.repeats)
        print(f"probe: matmul {rate / 1e9:.1f} GFLOP/s, memory bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
        cluster = this_host(rate, bandwidth)
        for name in SHAPES:
            spec = PRESETS[name]
            for seq in (SEQ, 4 * SEQ):
                fwd, bwd = attention_efficiency(spec, seq, rate)
                print(f"{name:12s} fused attention, head size {spec.head_dim:3d}, sequence {seq}: forward {fwd:.2f}, "
                      f"backward {bwd:.2f} of the matmul rate (the model: {params.cpu_attention_efficiency:.2f})",
                      flush=True)
        for name in SHAPES:
            spec = PRESETS[name]
            train = TrainConfig(global_batch=8, seq_len=SEQ, dtype="fp32")
            for mbs in MICRO_BATCHES:
                fwd, bwd = measured_layer(spec, mbs)
                model = layer_times(cluster, ["host/0"], spec, train, params, mbs)
                counted = layer_traffic(PartShape(spec, 1, mbs, SEQ, "fp32", "sdpa", on_cuda=False))
                rows.append(Pass(fwd, model.fwd_s, counted.fwd.bytes, counted.fwd.ops))
                rows.append(Pass(bwd, model.bwd_s, counted.bwd.bytes, counted.bwd.ops))
                print(f"{name:12s} mbs {mbs}: forward {fwd * 1e3:7.2f} ms, model {model.fwd_s * 1e3:7.2f} "
                      f"({model.fwd_s / fwd - 1:+6.1%});  backward {bwd * 1e3:7.2f} ms, model "
                      f"{model.bwd_s * 1e3:7.2f} ({model.bwd_s / bwd - 1:+6.1%})", flush=True)
    errors = [abs(row.model / row.measured - 1) for row in rows]
    factor, per_op, refit = refit_bytes_and_ops(rows, bandwidth, params)
    print(f"refitted: element-wise bytes at {factor:.2f}x the probe's copy bandwidth (the model: "
          f"{params.memory_bandwidth_efficiency:.2f}x) and {per_op * 1e6:.1f} us per operation (the model: "
          f"{params.cpu_op_seconds * 1e6:.1f}): median error {statistics.median(refit):.1%}, worst {max(refit):.1%}")
    print(f"check_cpu_layer_model: {len(rows)} passes, median error {statistics.median(errors):.1%}, "
          f"worst {max(errors):.1%}")


if __name__ == "__main__":
    main()

"""Derive the default matrix-product efficiency per device type from measured layer latencies.

Input: the Cephalo project's one-layer Llama latencies (github.com/benson-guo/cephalo,
data/model_latencies.json, MIT licence, copyright 2025 Benson Guo), a copy of which lives at
../shared/data/layer-latencies-cephalo.json beside the repository.
Output: src/flashflex_cli/cost/reference_efficiency.py, a plain Python table the package imports
(the package never reads ../shared at run time).

Derivation (docs/cost-model.md, "Compute time per micro-batch"): Cephalo fits each (model, GPU, sequence
length, dtype) as t(b) = intercept + slope * b, forward and backward, over micro-batch sizes b. The cost model
charges a layer's matrix products at an efficiency of the dense peak and its other operations' bytes at the
memory bandwidth (cost/traffic.py, a roofline sum). So per entry, the time the marginal sequence spends in matrix
products is the measured slope less its bytes at the catalog bandwidth (x memory_bandwidth_efficiency; the bytes
this runtime's eager 16-bit or fp32 layer moves, Cephalo's eager Llama layer being the same operations):
  matmul efficiency = 3 * F_fwd(1, s) / (max(0.3 (fwd_slope + bwd_slope), fwd_slope + bwd_slope - M / B) * peak)
  intercept factor  = (fwd_intercept + bwd_intercept) / (W / B)     (kept for reference; the model's fixed
                                                                      part per micro-batch is counted instead)
where F_fwd is our forward FLOPs of one layer for one sequence (flashflex_cli.model.flops.layer_fwd_flops), M the
bytes one sequence's forward and backward move besides the matrix products, peak the catalog's dense peak for
the measured dtype (the same fallback as Device.flops), W the layer's weight bytes in that dtype and B the
device's memory bandwidth. The floor keeps the matrix products at least 30% of the slope where the bandwidth
term would take nearly all of it; an entry faster than the catalog's peak allows (A10G's fp16) counts as 1. The default per (device type, dtype class) is the median over the Llama 7B,
13B and 33B entries with at least 3 measured micro-batch sizes.

Run: .venv/bin/python scripts/derive_efficiency.py [path/to/layer-latencies-cephalo.json]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from flashflex_cli.cost.activations import PartShape
from flashflex_cli.cost.params import CostParams
from flashflex_cli.cost.traffic import layer_traffic
from flashflex_cli.fileio import atomic_write_text
from flashflex_cli.hardware.catalog import device_type
from flashflex_cli.model.flops import layer_fwd_flops, layer_params
from flashflex_cli.model.spec import ModelSpec

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO.parent / "shared" / "data" / "layer-latencies-cephalo.json"
OUTPUT = REPO / "src" / "flashflex_cli" / "cost" / "reference_efficiency.py"

# Cephalo GPU keys -> catalog names. a100x40 is taken as the SXM part (same peak as PCIe).
GPU_NAMES = {
    "a100x40": "A100-40G-SXM", "a100x80": "A100-80G-SXM", "a10g": "A10G", "a6000": "RTX-A6000",
    "h100-nvl": "H100-NVL", "l4": "L4", "l40s": "L40S", "p100": "P100", "p40": "P40", "t4": "T4",
    "v100-pciex16": "V100-16G", "v100x16": "V100-16G", "v100x32": "V100-32G",
}
# Cephalo model keys -> the shape of the Llama 1 models they time (Touvron et al. 2023).
MODELS = {
    "deepspeedllama_7b": ModelSpec(name="llama-7b", hidden_size=4096, num_layers=32, num_heads=32,
                                   num_kv_heads=32, intermediate_size=11008, vocab_size=32000),
    "deepspeedllama_13b": ModelSpec(name="llama-13b", hidden_size=5120, num_layers=40, num_heads=40,
                                    num_kv_heads=40, intermediate_size=13824, vocab_size=32000),
    "deepspeedllama_33b": ModelSpec(name="llama-33b", hidden_size=6656, num_layers=60, num_heads=52,
                                    num_kv_heads=52, intermediate_size=17920, vocab_size=32000),
}
DTYPES = {"float16": "fp16", "float32": "fp32"}
MIN_POINTS = 3
# Measured points copied verbatim into the table for the package's tests (model, gpu, seq, dtype, b).
TEST_POINTS = (
    ("deepspeedllama_7b", "a100x80", "4096", "float16", 1),
    ("deepspeedllama_13b", "a100x40", "2048", "float16", 2),
    ("deepspeedllama_13b", "v100x16", "2048", "float16", 1),
    ("deepspeedllama_7b", "t4", "2048", "float16", 1),
    ("deepspeedllama_33b", "a10g", "2048", "float16", 1),
    ("deepspeedllama_13b", "h100-nvl", "2048", "float16", 2),
    ("deepspeedllama_7b", "l4", "2048", "float16", 2),
)


def peak(gpu: str, dtype: str) -> float:
    """Dense catalog peak for `dtype`, with Device.flops' fallback (fp16 -> fp32)."""
    flops = device_type(GPU_NAMES[gpu]).peak_flops
    return flops.get(dtype) or flops["fp32"]


def fit_entries(data: dict) -> list[tuple[str, float, float]]:
    """(type:dtype, slope efficiency, intercept factor) of every usable fitted entry (module docstring)."""
    rows = []
    for model_key, model in MODELS.items():
        for gpu, by_seq in data.get(model_key, {}).items():
            for seq_text, by_dtype in by_seq.items():
                seq = int(seq_text)
                for dtype_key, value in by_dtype.items():
                    if not isinstance(value, list) or len(value) < 4 or dtype_key not in DTYPES:
                        continue
                    if len(value[2]) < MIN_POINTS:
                        continue
                    dtype = DTYPES[dtype_key]
                    (fwd_slope, fwd_icpt), (bwd_slope, bwd_icpt) = value[0], value[1]
                    slope_s = (fwd_slope + bwd_slope) * 1e-3
                    matmul_s = max(0.3 * slope_s, slope_s - sequence_bytes(model, seq, dtype) / bandwidth(gpu) / BW_EFF)
                    eff = min(1.0, 3.0 * layer_fwd_flops(model, 1, seq) / (matmul_s * peak(gpu, dtype)))
                    weight_read_s = layer_params(model) * (2 if dtype == "fp16" else 4) / bandwidth(gpu)
                    factor = (fwd_icpt + bwd_icpt) * 1e-3 / weight_read_s
                    rows.append((f"{GPU_NAMES[gpu]}:{dtype}", eff, factor))
    return rows


BW_EFF = CostParams().memory_bandwidth_efficiency


def sequence_bytes(model: ModelSpec, seq: int, dtype: str) -> float:
    """Bytes one sequence's forward and backward through one eager layer move besides its matrix products."""
    traffic = layer_traffic(PartShape(model, 1, 1, seq, dtype, "sdpa", on_cuda=True))
    return traffic.fwd.bytes + traffic.bwd.bytes - 24.0 * layer_params(model)  # the weights' terms: per micro-batch


def bandwidth(gpu: str) -> float:
    """Catalog memory bandwidth (bytes/s) of a Cephalo GPU key."""
    return device_type(GPU_NAMES[gpu]).memory_bandwidth


def derive(data: dict) -> tuple[dict[str, tuple[float, float, int]], list[tuple]]:
    """Per (type, dtype): (median slope efficiency, median intercept factor, entries); the test points."""
    samples: dict[str, list[tuple[float, float]]] = {}
    for key, eff, factor in fit_entries(data):
        samples.setdefault(key, []).append((eff, factor))
    table = {key: (round(statistics.median(e for e, _ in vals), 3), round(statistics.median(f for _, f in vals), 2),
                   len(vals))
             for key, vals in sorted(samples.items())}
    points = []
    for model_key, gpu, seq, dtype_key, batch in TEST_POINTS:
        if model_key not in data:  # a subset of the data (the benchmark's leave-one-model-out check)
            continue
        value = data[model_key][gpu][seq][dtype_key]
        points.append((model_key, GPU_NAMES[gpu], int(seq), DTYPES[dtype_key], batch,
                       round(value[2][batch - 1], 4), round(value[3][batch - 1], 4),
                       round(value[0][0] + value[1][0], 4)))
    return table, points


def render(table: dict[str, tuple[float, int]], points: list[tuple]) -> str:
    """The generated module's text."""
    lines = [
        '"""GENERATED by scripts/derive_efficiency.py; do not edit by hand.',
        "",
        "Matrix-product efficiency of one Llama layer per 'DEVICE-TYPE:dtype': e = FLOP/s the marginal sequence's",
        "matrix products achieve over the dense catalog peak, once its other operations' bytes are taken at the",
        "memory bandwidth (cost/traffic.py); a = the fitted intercept in reads of the layer's weights (reference",
        "only: the model counts the fixed part of a micro-batch). Medians over",
        "N fitted entries of the Cephalo project's layer latencies (github.com/benson-guo/cephalo,",
        "data/model_latencies.json; MIT licence, Copyright (c) 2025 Benson Guo). MEASURED_POINTS are verbatim",
        "entries of that file: (cephalo model key, device type, seq_len, dtype, micro-batch size, forward ms,",
        "backward ms, fitted forward + backward slope in ms per sequence).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "# 'DEVICE-TYPE:dtype' -> (matmul efficiency, intercept factor, number of fitted entries)",
        "REFERENCE_EFFICIENCY: dict[str, tuple[float, float, int]] = {",
    ]
    lines += [f"    {key!r}: ({eff!r}, {factor!r}, {n}),".replace("'", '"') for key, (eff, factor, n) in table.items()]
    lines += ["}", "", "MEASURED_POINTS: tuple[tuple[str, str, int, str, int, float, float, float], ...] = ("]
    lines += [f"    {tuple(point)!r},".replace("'", '"') for point in points]
    lines += [")", ""]
    return "\n".join(lines)


def main() -> None:
    """Read the Cephalo data, print the table, write the generated module."""
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SOURCE
    table, points = derive(json.loads(source.read_text()))
    for key, (eff, factor, n) in table.items():
        print(f"{key:20s} matmul efficiency {eff:6.3f}  intercept {factor:6.2f} weight reads  (n={n})")
    atomic_write_text(OUTPUT, render(table, points))
    print(f"wrote {OUTPUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()

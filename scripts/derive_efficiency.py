"""Derive the default compute efficiency per device type from measured layer latencies.

Input: the Cephalo project's one-layer Llama latencies (github.com/benson-guo/cephalo,
data/model_latencies.json, MIT licence, copyright 2025 Benson Guo), a copy of which lives at
../shared/data/layer-latencies-cephalo.json beside the repository.
Output: src/flashflex_cli/cost/reference_efficiency.py, a plain Python table the package imports
(the package never reads ../shared at run time).

Derivation (docs/cost-model.md, "Compute efficiency"):
  efficiency = 3 * F_fwd(b, s) / ((t_fwd + t_bwd) * peak)
where F_fwd is our forward FLOPs of one layer (flashflex_cli.model.flops.layer_fwd_flops), t_fwd and
t_bwd the measured times of one layer for micro-batch size b at sequence length s, and peak the
catalog's dense peak for the measured dtype (the same fallback as Device.flops). The default per
(device type, dtype class) is the median over the Llama 7B, 13B and 33B entries and every measured
point whose micro-batch holds 2048 to 8192 tokens (b * s), the range flashflex plans for.

Run: .venv/bin/python scripts/derive_efficiency.py [path/to/layer-latencies-cephalo.json]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from flashflex_cli.fileio import atomic_write_text
from flashflex_cli.hardware.catalog import device_type
from flashflex_cli.model.flops import layer_fwd_flops
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
MIN_TOKENS, MAX_TOKENS = 2048, 8192
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


def derive(data: dict) -> tuple[dict[str, tuple[float, int]], list[tuple]]:
    """The per-(type, dtype) median efficiencies and the verbatim test points."""
    samples: dict[str, list[float]] = {}
    for model_key, model in MODELS.items():
        for gpu, by_seq in data.get(model_key, {}).items():
            for seq_text, by_dtype in by_seq.items():
                seq = int(seq_text)
                for dtype_key, value in by_dtype.items():
                    if not isinstance(value, list) or len(value) < 4 or dtype_key not in DTYPES:
                        continue
                    dtype = DTYPES[dtype_key]
                    for index, (fwd_ms, bwd_ms) in enumerate(zip(value[2], value[3], strict=False)):
                        batch = index + 1
                        if not MIN_TOKENS <= batch * seq <= MAX_TOKENS:
                            continue
                        flops = 3.0 * layer_fwd_flops(model, batch, seq)
                        eff = flops / ((fwd_ms + bwd_ms) * 1e-3 * peak(gpu, dtype))
                        samples.setdefault(f"{GPU_NAMES[gpu]}:{dtype}", []).append(eff)
    table = {key: (round(statistics.median(vals), 3), len(vals)) for key, vals in sorted(samples.items())}
    points = []
    for model_key, gpu, seq, dtype_key, batch in TEST_POINTS:
        if model_key not in data:  # a subset of the data (the benchmark's leave-one-model-out check)
            continue
        value = data[model_key][gpu][seq][dtype_key]
        points.append((model_key, GPU_NAMES[gpu], int(seq), DTYPES[dtype_key], batch,
                       round(value[2][batch - 1], 4), round(value[3][batch - 1], 4)))
    return table, points


def render(table: dict[str, tuple[float, int]], points: list[tuple]) -> str:
    """The generated module's text."""
    lines = [
        '"""GENERATED by scripts/derive_efficiency.py; do not edit by hand.',
        "",
        "Default compute efficiency (achieved FLOP/s of one Llama layer, forward + backward, over the dense",
        "catalog peak) per 'DEVICE-TYPE:dtype', the median of N measured points, derived from the Cephalo",
        "project's layer latencies (github.com/benson-guo/cephalo, data/model_latencies.json;",
        "MIT licence, Copyright (c) 2025 Benson Guo). MEASURED_POINTS are verbatim entries of that file:",
        "(cephalo model key, device type, seq_len, dtype, micro-batch size, forward ms, backward ms).",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "# 'DEVICE-TYPE:dtype' -> (efficiency, number of measured points)",
        "REFERENCE_EFFICIENCY: dict[str, tuple[float, int]] = {",
    ]
    lines += [f"    {key!r}: ({eff!r}, {n}),".replace("'", '"') for key, (eff, n) in table.items()]
    lines += ["}", "", "MEASURED_POINTS: tuple[tuple[str, str, int, str, int, float, float], ...] = ("]
    lines += [f"    {tuple(point)!r},".replace("'", '"') for point in points]
    lines += [")", ""]
    return "\n".join(lines)


def main() -> None:
    """Read the Cephalo data, print the table, write the generated module."""
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_SOURCE
    table, points = derive(json.loads(source.read_text()))
    for key, (eff, n) in table.items():
        print(f"{key:20s} {eff:6.3f}  (n={n})")
    atomic_write_text(OUTPUT, render(table, points))
    print(f"wrote {OUTPUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()

"""Count the runtime's operations per part and fit the byte counts cost/traffic.py writes out.

Each part (a decoder layer; the head with the whole-vocabulary loss; the head with the chunked loss, per chunk)
runs forward and backward on CPU, eager, in bf16 autocast and in fp32, under the dispatch-mode counter of
tests/infra/op_traffic.py, over ten shapes (micro-batches of 80 and 192 tokens) chosen so that the widths vary
independently. The bytes moved besides matrix products are fitted by least squares as linear in
N h, N q, N k, N (q + k) [grouped-query heads], N f and W (layer), or N h, N V, V h (head), or also V h per chunk
and chunks (chunked head); the rounded coefficients, their error on the fitted shapes and on three held-out shapes
and the operation and kernel counts are printed. tests/test_cost_traffic.py re-counts two held-out shapes.

Run: .venv/bin/python scripts/count_traffic.py   (about a minute on one core)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/infra/op_traffic.py

from tests.infra.op_traffic import count_part  # noqa: E402

from flashflex_cli.model.spec import ModelSpec  # noqa: E402

# (hidden, MLP, heads, kv heads, head_dim override)
FIT = [(128, 512, 4, 2, None), (96, 320, 6, 6, None), (160, 256, 5, 1, None), (256, 688, 8, 4, None),
       (64, 768, 4, 4, None), (192, 384, 6, 3, None), (128, 384, 4, 2, 48), (96, 512, 3, 1, 40),
       (160, 640, 8, 8, 16), (224, 448, 7, 7, 24)]
HELD_OUT = [(320, 864, 10, 2, None), (144, 1024, 6, 6, 40), (512, 1376, 8, 2, None)]
RUNS = ((2, 40), (3, 64))
HEADS = [(128, 1000), (96, 3000), (256, 2000), (64, 5000), (160, 1500), (200, 800)]


def layer_features(shape: tuple, n: int) -> list[float]:
    h, f, heads, kv, head_dim = shape
    hd = head_dim or h // heads
    q, k, grouped = heads * hd, kv * hd, float(kv < heads)
    return [n * h, n * q, n * k, n * (q + k) * grouped, n * f, 2 * h * q + 2 * h * k + 3 * h * f]


def fit(rows: list[tuple[list[float], float]], held: list[tuple[list[float], float]], names: list[str]) -> str:
    x = np.array([r[0] for r in rows]); y = np.array([r[1] for r in rows])  # noqa: E702
    coef = np.round(np.linalg.lstsq(x, y, rcond=None)[0], 1)
    error = np.max(np.abs(x @ coef - y) / y)
    text = " + ".join(f"{c:g} {n}" for c, n in zip(coef, names, strict=True) if c)
    if held:
        xh = np.array([r[0] for r in held]); yh = np.array([r[1] for r in held])  # noqa: E702
        text += f"   (fit {100 * error:.2f}%, held out {100 * np.max(np.abs(xh @ coef - yh) / yh):.2f}%)"
    return text + f"   (fit {100 * error:.2f}%)" if not held else text


def main() -> None:
    torch.manual_seed(0)
    for dtype in ("bf16", "fp32"):
        data: dict[tuple[str, str], list] = {}
        for tag, shapes in (("fit", FIT), ("held", HELD_OUT)):
            for shape in shapes:
                spec = ModelSpec(name="x", hidden_size=shape[0], num_layers=1, num_heads=shape[2],
                                 num_kv_heads=shape[3], intermediate_size=shape[1], vocab_size=500,
                                 head_dim_override=shape[4])
                for b, s in RUNS:
                    fwd, bwd = count_part(spec, "layer", b, s, dtype)
                    for name, count in (("forward", fwd), ("backward", bwd)):
                        data.setdefault((tag, name), []).append((layer_features(shape, b * s), count.bytes))
                        data.setdefault(("ops", name), []).append((count.ops, count.kernels))
        for name in ("forward", "backward"):
            print(f"layer {dtype} {name}: {fit(data[('fit', name)], data[('held', name)], ['Nh', 'Nq', 'Nk', 'N(q+k)[grouped]', 'Nf', 'W'])}"
                  f"; operations / kernels {sorted(set(data[('ops', name)]))}")
        for chunk in (None, 50):
            rows: dict[str, list] = {}
            for h, v in HEADS:
                spec = ModelSpec(name="x", hidden_size=h, num_layers=1, num_heads=4, num_kv_heads=4,
                                 intermediate_size=256, vocab_size=v)
                for b, s in (*RUNS, (4, 50)):
                    n = b * s
                    chunks = math.ceil(n / chunk) if chunk else 1
                    fwd, bwd = count_part(spec, "head", b, s, dtype, chunk)
                    for name, count in (("forward", fwd), ("backward", bwd)):
                        rows.setdefault(name, []).append(([n * h, n * v, v * h, v * h * chunks], count.bytes))
                        rows.setdefault(name + " ops", []).append((count.ops, count.kernels, chunks))
            label = f"head, chunks of {chunk}" if chunk else "head, whole vocabulary"
            for name in ("forward", "backward"):
                print(f"{label} {dtype} {name}: {fit(rows[name], [], ['Nh', 'NV', 'Vh', 'Vh per chunk'])}"
                      f"; (operations, kernels, chunks) {sorted(set(rows[name + ' ops']))}")


if __name__ == "__main__":
    main()

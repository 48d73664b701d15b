"""Our compute term (one Llama layer, forward + backward) against every measured Cephalo point.

Prints predicted / measured per device type (median, min, max over points with 2048-8192 tokens per
micro-batch) and the same ratio for a baseline that assumes every device reaches its full dense peak
(efficiency 1.0), so the effect of the derived efficiencies is visible.

Needs ../shared/data/layer-latencies-cephalo.json (or a path as the first argument).
Run: .venv/bin/python benchmarks/bench_cost_vs_measured.py
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

from flashflex_cli.cost.compute import layer_times
from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.catalog import device_type
from flashflex_cli.hardware.cluster import Cluster
from flashflex_cli.model.spec import PRESETS, ModelSpec
from flashflex_cli.plan.schema import TrainConfig

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO.parent / "shared" / "data" / "layer-latencies-cephalo.json"
sys.path.insert(0, str(REPO / "scripts"))
from derive_efficiency import GPU_NAMES, MAX_TOKENS, MIN_TOKENS, derive  # noqa: E402

SHAPES = {"deepspeedllama_7b": "llama2-7b", "deepspeedllama_13b": "llama2-13b", "deepspeedllama_33b": "llama-30b"}
DTYPES = {"float16": "fp16", "float32": "fp32"}


def one_device(type_name: str) -> Cluster:
    entry = device_type(type_name)
    return Cluster.model_validate({"nodes": [{"name": "n", "devices": [{
        "type": entry.name, "memory_bytes": entry.memory_bytes, "peak_flops": entry.peak_flops,
        "memory_bandwidth": entry.memory_bandwidth}]}]})


def measured_points(data: dict) -> Iterator[tuple[Cluster, ModelSpec, TrainConfig, int, float]]:
    """Every measured (device, model, micro-batch) point with 2048-8192 tokens: the micro-batch size (sequences)
    and the measured fwd+bwd seconds."""
    for key, preset in SHAPES.items():
        for gpu, by_seq in data.get(key, {}).items():
            cluster = one_device(GPU_NAMES[gpu])
            for seq, by_dtype in by_seq.items():
                for dkey, value in by_dtype.items():
                    if dkey not in DTYPES or not isinstance(value, list) or len(value) < 4:
                        continue
                    for i, (f_ms, b_ms) in enumerate(zip(value[2], value[3], strict=False)):
                        if MIN_TOKENS <= (i + 1) * int(seq) <= MAX_TOKENS:
                            train = TrainConfig(global_batch=i + 1, seq_len=int(seq), dtype=DTYPES[dkey])
                            yield cluster, PRESETS[preset], train, i + 1, (f_ms + b_ms) / 1e3


def main() -> None:
    data = json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else SOURCE).read_text())
    ours, peak_only = CostParams(), CostParams(compute_efficiency={}, default_compute_efficiency=1.0)
    ratios: dict[str, list[tuple[float, float]]] = {}
    for cluster, model, train, mbs, measured in measured_points(data):
        a = layer_times(cluster, ["n/0"], model, train, ours, micro_batch_size=mbs)
        b = layer_times(cluster, ["n/0"], model, train, peak_only, micro_batch_size=mbs)
        ratios.setdefault(f"{cluster.nodes[0].devices[0].type}:{train.dtype}", []).append(
            ((a.fwd_s + a.bwd_s) / measured, (b.fwd_s + b.bwd_s) / measured))
    print(f"{'device:dtype':20s} {'n':>4s}  {'ours median [min, max]':>26s}   {'peak-only median':>16s}")
    all_ours, all_peak = [], []
    for key in sorted(ratios):
        ours_r = [r[0] for r in ratios[key]]
        peak_r = [r[1] for r in ratios[key]]
        all_ours += ours_r
        all_peak += peak_r
        print(f"{key:20s} {len(ours_r):4d}  {statistics.median(ours_r):8.3f} [{min(ours_r):.3f}, {max(ours_r):.3f}]"
              f"   {statistics.median(peak_r):16.3f}")
    err = statistics.median(abs(r - 1) for r in all_ours)
    err_peak = statistics.median(abs(r - 1) for r in all_peak)
    print(f"in-sample: median |predicted/measured - 1| over {len(all_ours)} points: ours {err:.3f}, "
          f"peak-only baseline {err_peak:.3f} (ratio {err_peak / err:.1f}x)")
    held_out(data)


def held_out(data: dict) -> None:
    """Leave one model out: derive the efficiencies from the other two, predict the held-out model."""
    errors: list[float] = []
    for key in SHAPES:
        table, _ = derive({k: v for k, v in data.items() if k != key})
        params = CostParams(compute_efficiency={k: e for k, (e, _n) in table.items()})
        model_errors = []
        for cluster, model, train, mbs, measured in measured_points({key: data[key]}):
            lt = layer_times(cluster, ["n/0"], model, train, params, micro_batch_size=mbs)
            model_errors.append(abs((lt.fwd_s + lt.bwd_s) / measured - 1))
        errors += model_errors
        print(f"held out {key:20s}: median |predicted/measured - 1| {statistics.median(model_errors):.3f} "
              f"over {len(model_errors)} points (p90 {statistics.quantiles(model_errors, n=10)[-1]:.3f})")
    print(f"held out, all models: median |predicted/measured - 1| {statistics.median(errors):.3f}")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# `make demo`: profile this machine, plan the bundled emulated heterogeneous CPU cluster, prepare data from
# a text file in the repository, train on 4 CPU ranks, then close the loop: measure
# the model's layers here, calibrate them with the run, and put prediction and measurement side by side.
# Settings: DEMO_OUT (default runs/demo), DEMO_STEPS (default 30), FLASHFLEX (default .venv/bin/flashflex).
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHFLEX="${FLASHFLEX:-.venv/bin/flashflex}"
PYTHON="${PYTHON:-.venv/bin/python}"
OUT="${DEMO_OUT:-runs/demo}"
STEPS="${DEMO_STEPS:-30}"
CLUSTER=profiles/cpu-emulated.json
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$OUT"
say() { printf '\n\033[1m==> %s\033[0m\n' "$*" >&2; }
start=$(date +%s)

say "1/8 Profile this machine (quick probes): $OUT/local.json"
"$FLASHFLEX" profile --out "$OUT/local.json" --quick

say "2/8 The bundled emulated heterogeneous cluster: $CLUSTER"
"$PYTHON" - "$CLUSTER" <<'EOF' >&2
import sys
from flashflex_cli.hardware.cluster import load_cluster
cluster = load_cluster(sys.argv[1])
print(f"{cluster.name}: {cluster.description or ''}")
for node in cluster.nodes:
    for i, d in enumerate(node.devices):
        print(f"  {node.name}/{i}: {d.type}, {d.flops('fp32') / 1e9:.0f} GFLOP/s fp32 (slowdown x{d.slowdown:g})")
EOF

say "3/8 Plan llama-small (fp32, global batch 16 x 128 tokens) on it: $OUT/plan.json"
"$FLASHFLEX" plan "$CLUSTER" --model llama-small --global-batch 16 --seq-len 128 --dtype fp32 --seed 0 \
    --time-budget 20 --out "$OUT/plan.json"

say "4/8 Show the plan"
"$FLASHFLEX" show "$OUT/plan.json" --cluster "$CLUSTER"

say "5/8 Prepare data: data/lighthouse.txt -> $OUT/data.bin (byte-level tokens)"
"$FLASHFLEX" data prepare data/lighthouse.txt --out "$OUT/data.bin"

say "6/8 Launch: one process per emulated device, $STEPS steps"
rm -rf "$OUT/ckpt"
"$FLASHFLEX" launch "$OUT/plan.json" --cluster "$CLUSTER" --data "$OUT/data.bin" --steps "$STEPS" \
    --out "$OUT/run" --checkpoint-dir "$OUT/ckpt" --checkpoint-every 10

"$PYTHON" - "$OUT/run/metrics.jsonl" <<'EOF' >&2
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
first, last = rows[0]["loss"], rows[-1]["loss"]
print(f"\nloss {first:.3f} -> {last:.3f} over {len(rows)} steps ({'down' if last < first else 'NOT down'})")
EOF
say "7/8 Measure llama-small's layers on this machine and calibrate them with the run: $OUT/cpu.layers.json"
"$FLASHFLEX" profile --model llama-small --seq-len 128 --micro-batch 1,2 --tp 1 --dtype fp32 --repeats 3 \
    --out "$OUT/cpu.measured.layers.json"
"$FLASHFLEX" calibrate "$OUT/run" --layers "$OUT/cpu.measured.layers.json" --out "$OUT/cpu.layers.json" 2>&1 \
    | grep "measured forward" >&2 || true

say "8/8 Predicted (calibrated) against measured, per stage"
"$FLASHFLEX" show "$OUT/plan.json" --cluster "$CLUSTER" --layers "$OUT/cpu.layers.json" --run "$OUT/run" 2>&1 \
    | sed -n '/predicted vs measured/,$p' >&2

say "Done in $(( $(date +%s) - start )) s. Metrics: $OUT/run/metrics.jsonl (one JSON object per step);" \
    "checkpoints: $OUT/ckpt; plan: $OUT/plan.json"

#!/usr/bin/env bash
# `make demo`: profile this machine, plan the bundled emulated heterogeneous CPU cluster, prepare data from
# a text file in the repository, train on 4 CPU ranks, then close the loop: measure
# the model's layers here, calibrate them with the run, and put prediction and measurement side by side;
# last, an elastic run survives a worker killed from outside by re-planning (docs/elastic.md).
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

say "1/9 Profile this machine (quick probes): $OUT/local.json"
"$FLASHFLEX" profile --out "$OUT/local.json" --quick

say "2/9 The bundled emulated heterogeneous cluster: $CLUSTER"
"$PYTHON" - "$CLUSTER" <<'EOF' >&2
import sys
from flashflex_cli.hardware.cluster import load_cluster
cluster = load_cluster(sys.argv[1])
print(f"{cluster.name}: {cluster.description or ''}")
for node in cluster.nodes:
    for i, d in enumerate(node.devices):
        print(f"  {node.name}/{i}: {d.type}, {d.flops('fp32') / 1e9:.0f} GFLOP/s fp32 (slowdown x{d.slowdown:g})")
EOF

say "3/9 Plan llama-small (fp32, global batch 16 x 128 tokens) on it: $OUT/plan.json"
"$FLASHFLEX" plan "$CLUSTER" --model llama-small --global-batch 16 --seq-len 128 --dtype fp32 --seed 0 \
    --time-budget 20 --out "$OUT/plan.json"

say "4/9 Show the plan"
"$FLASHFLEX" show "$OUT/plan.json" --cluster "$CLUSTER"

say "5/9 Prepare data: data/lighthouse.txt -> $OUT/data.bin (byte-level tokens)"
"$FLASHFLEX" data prepare data/lighthouse.txt --out "$OUT/data.bin"

say "6/9 Launch: one process per emulated device, $STEPS steps"
"$FLASHFLEX" launch "$OUT/plan.json" --cluster "$CLUSTER" --data "$OUT/data.bin" --steps "$STEPS" \
    --out "$OUT/run" --checkpoint-every 10 --overwrite

"$PYTHON" - "$OUT/run/metrics.jsonl" <<'EOF' >&2
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
first, last = rows[0]["loss"], rows[-1]["loss"]
print(f"\nloss {first:.3f} -> {last:.3f} over {len(rows)} steps ({'down' if last < first else 'NOT down'})")
EOF
say "7/9 Measure llama-small's layers on this machine and calibrate them with the run: $OUT/cpu.layers.json"
"$FLASHFLEX" profile --model llama-small --seq-len 128 --micro-batch 1,2 --tp 1 --dtype fp32 --repeats 3 \
    --out "$OUT/cpu.measured.layers.json"
"$FLASHFLEX" calibrate "$OUT/run" --layers "$OUT/cpu.measured.layers.json" --out "$OUT/cpu.layers.json" 2>&1 \
    | grep "measured forward" >&2 || true

say "8/9 Predicted (calibrated) against measured, per stage"
"$FLASHFLEX" show "$OUT/plan.json" --cluster "$CLUSTER" --layers "$OUT/cpu.layers.json" --run "$OUT/run" 2>&1 \
    | sed -n '/predicted vs measured/,$p' >&2

say "9/9 Elastic: kill one worker of a small run from outside; the launcher re-plans on the rest and resumes"
"$FLASHFLEX" plan "$CLUSTER" --model llama-tiny --global-batch 8 --seq-len 32 --micro-batch 1 --dtype fp32 \
    --seed 0 --time-budget 10 --no-baseline --out "$OUT/elastic-plan.json" 2>/dev/null
rm -rf "$OUT/elastic-run" "$OUT/elastic-ckpt"
"$FLASHFLEX" launch "$OUT/elastic-plan.json" --elastic --steps 12 --checkpoint-dir "$OUT/elastic-ckpt" \
    --checkpoint-every 2 --out "$OUT/elastic-run" --timeout 20 2>"$OUT/elastic.log" &
launcher=$!
"$PYTHON" - "$OUT/elastic-run" <<'EOF' >&2
import json, os, signal, sys, time
run = sys.argv[1]
deadline = time.monotonic() + 90
while time.monotonic() < deadline:  # until step 4 of 12 is done
    try:
        rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl")) if line.strip()]
        if rows and rows[-1]["step"] >= 3:
            break
    except (OSError, ValueError, KeyError):
        pass
    time.sleep(0.05)
victim = json.load(open(os.path.join(run, "workers.json")))["workers"][-1]
print(f"kill -9 {victim['pid']}: the worker of device {victim['device']}")
os.kill(victim["pid"], signal.SIGKILL)
EOF
wait "$launcher" || { cat "$OUT/elastic.log" >&2; exit 1; }
grep -E "^(elastic:|flashflex: resumed)" "$OUT/elastic.log" >&2
echo "event: $(tail -n 1 "$OUT/elastic-run/events.jsonl")" >&2

say "Done in $(( $(date +%s) - start )) s. Metrics: $OUT/run/metrics.jsonl (one JSON object per step);" \
    "checkpoints: $OUT/run/checkpoints; plan: $OUT/plan.json"

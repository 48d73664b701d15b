#!/usr/bin/env bash
# Regenerate every committed plan in plans/ (called by `make plans`).
# Usage: scripts/make_plans.sh [OUT_DIR]   (default: plans/; tests/test_committed_plans.py writes to a temp dir
# and compares byte for byte). Plans are deterministic for given inputs and seed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-plans}"
FLASHFLEX="${FLASHFLEX:-.venv/bin/flashflex}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
mkdir -p "$OUT"

# The CPU demo plan uses fp32: the runtime trains in fp32 on CPU.
# profile            model        global-batch  seq-len  dtype
PLANS="
paper-hetero-1       llama2-7b    256           4096     bf16
paper-hetero-2       llama2-13b   256           4096     bf16
paper-hetero-3       llama2-13b   512           4096     bf16
paper-homo-a100-2x8  llama2-7b    128           4096     bf16
paper-homo-a100-4x8  llama2-13b   256           4096     bf16
holmes-mixed-nic     llama2-13b   256           4096     bf16
cpu-emulated         llama-small  16            128      fp32
"

LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
echo "$PLANS" | while read -r profile model batch seq dtype; do
    [ -z "$profile" ] && continue
    if ! "$FLASHFLEX" plan "profiles/$profile.json" --model "$model" --global-batch "$batch" --seq-len "$seq" \
        --dtype "$dtype" --seed 0 --time-budget 120 --out "$OUT/$profile.json" --no-baseline 2>"$LOG"; then
        cat "$LOG" >&2
        exit 1
    fi
    echo "wrote $OUT/$profile.json"
done

#!/usr/bin/env bash
# `make demo-finetune`: fine-tune a (tiny, random, local) Hugging Face Llama checkpoint on the emulated
# heterogeneous CPU cluster and export the result back to Hugging Face files. No network access.
#   1. write a tiny random HF checkpoint (transformers if installed, else safetensors + config.json)
#   2. plan its model (read from its config.json) on the bundled emulated cluster
#   3. prepare data, 4. fine-tune from the checkpoint (--init-from), 5. export (flashflex export --hf)
#   6. check the export: transformers' logits (when installed), else the safetensors headers
# Settings: FT_OUT (default runs/demo-finetune), FT_STEPS (default 20), FT_MODEL (default llama-tiny),
# FT_SEQ (default 64), FT_BATCH (default 8), FT_PLAN_BUDGET (planner seconds, default 5),
# FLASHFLEX (default .venv/bin/flashflex), PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHFLEX="${FLASHFLEX:-.venv/bin/flashflex}"
PYTHON="${PYTHON:-.venv/bin/python}"
OUT="${FT_OUT:-runs/demo-finetune}"
STEPS="${FT_STEPS:-20}"
MODEL="${FT_MODEL:-llama-tiny}"
SEQ="${FT_SEQ:-64}"
BATCH="${FT_BATCH:-8}"
BUDGET="${FT_PLAN_BUDGET:-5}"
CLUSTER=profiles/cpu-emulated.json
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
say() { printf '\n\033[1m==> %s\033[0m\n' "$*" >&2; }
start=$(date +%s)
rm -rf "$OUT"
mkdir -p "$OUT"

say "1/6 A tiny random Hugging Face checkpoint ($MODEL): $OUT/hf-base"
"$PYTHON" -m flashflex_cli.hf.tiny "$OUT/hf-base" --model "$MODEL" --seed 0

say "2/6 Plan it (model from $OUT/hf-base/config.json) on $CLUSTER: $OUT/plan.json"
"$FLASHFLEX" plan "$CLUSTER" --model "$OUT/hf-base/config.json" --global-batch "$BATCH" --seq-len "$SEQ" \
    --dtype fp32 --seed 0 --time-budget "$BUDGET" --out "$OUT/plan.json"

say "3/6 Prepare data: data/lighthouse.txt -> $OUT/data.bin (byte-level tokens)"
"$FLASHFLEX" data prepare data/lighthouse.txt --out "$OUT/data.bin"

say "4/6 Fine-tune $STEPS steps from the checkpoint (--init-from)"
"$FLASHFLEX" launch "$OUT/plan.json" --cluster "$CLUSTER" --data "$OUT/data.bin" --steps "$STEPS" \
    --init-from "$OUT/hf-base" --lr 3e-3 --out "$OUT/run"

say "5/6 Export the fine-tuned weights: $OUT/hf-finetuned"
"$FLASHFLEX" export "$OUT/run" --hf "$OUT/hf-finetuned"

say "6/6 Check the export"
"$PYTHON" - "$OUT" <<'PYEOF' >&2
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
print(f"fine-tuning loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} over {len(rows)} steps")
try:
    import torch
    from transformers import AutoModelForCausalLM
except ImportError:
    from flashflex_cli.hf.files import HFCheckpoint
    ckpt = HFCheckpoint(out / "hf-finetuned")
    print(f"transformers not installed: {len(ckpt.entries)} tensors readable in {out / 'hf-finetuned'}")
else:
    tokens = torch.tensor([list(b"The lighthouse keeper climbed the stairs")])
    for name in ("hf-base", "hf-finetuned"):
        model = AutoModelForCausalLM.from_pretrained(str(out / name), dtype=torch.float32)
        loss = model(tokens, labels=tokens).loss.item()
        print(f"transformers loads {name}: loss on a sample sentence {loss:.3f}")
PYEOF
say "Done in $(( $(date +%s) - start )) s: $OUT/hf-finetuned (config.json, model.safetensors)"

#!/usr/bin/env bash
# The GPU checks the open issues name, as one script for a lent one-GPU machine (the `device` tool), so a session
# that is lent one spends its minutes measuring, not preparing. Check it here first: FLASHFLEX_SESSION_CPU=1 runs
# every step on this machine's CPU with a tiny model (a check of the script, not a measurement).
#
#   bash benchmarks/gpu_session.sh [memory] [profile] [speed] [ablations] [fp16] [ranks] [sharded] [multigpu]
#                                                          (default: the first four, in that order)
#
# memory:  plans llama-1b (seq 2048, 16 sequences) pinned at micro-batch 1, 2, 4, 8 and a 3B-class shape (Llama 3.2
#          3B, searched micro-batch), launches each plan the planner emits for 6 steps, then replays every run with
#          benchmarks/validate_gpu_memory.py (predicted vs measured peak and step time; oom-safe). A plan the planner
#          refuses is logged as refused: it predicted the shape not to fit.
# profile: `flashflex profile --model` on the GPU at micro-batch 1, 2, 4, then the same replay with that profile.
# speed:   benchmarks/bench_gpu_runtime.py (the runtime against a Hugging Face loop under torch.compile, and
#          `flashflex launch`), with --trace: each variant's top 40 CUDA kernels in bench_gpu_runtime-trace.txt.
# ablations: the same benchmark with every path switched off or changed in turn (--ablations --skip-launch: no
#          compile, unchunked loss, foreach AdamW, compile per block against the whole stage, weights cast once,
#          torch's fused loss), traced to bench_gpu_runtime-ablations-trace.txt.
# fp16:    the same one-GPU plan launched in bf16 and in fp16 (loss scaling): tokens/s and losses side by side.
# ranks:   multi-rank plans on the one GPU (`flashflex launch --share-gpu`: every rank its own NCCL host), by
#          benchmarks/ranks_session.py: a 2-stage pipeline of a tied-embedding model with overlapped DP, 4 stages, a
#          TP-2 stage, a TP change at a stage boundary, two unlike pipelines in DP, fp16 with loss scaling,
#          recompute, the TP-2 stage compiled whole (all-reduces traced) and per block, a checkpoint and a resume
#          under another plan; each run's losses against the one-rank run of
#          the same model and data, then every rank's peak memory against its stage's prediction
#          (validate_gpu_memory.py; its time figures are no target: the ranks share the GPU). ranks.txt in $OUT.
# sharded: two ranks in data parallel on the one GPU (--share-gpu), the optimizer state sharded across them and not
#          (benchmarks/ranks_session.py --sharded): losses against one rank, every rank's peak memory against its
#          prediction (validate_gpu_memory.py). sharded.txt in $OUT.
# multigpu: the CUDA-marked tests (tests/test_multi_gpu.py: NCCL runs against the one-process reference) where the
#          machine has two or more GPUs; skipped, with a line saying so, elsewhere.
#
# Output: everything goes to $OUT (the device tool brings it back) or /tmp/gpu-session: session.log, the run
# folders' metrics as runs.tar.gz, the layer profile. Each step has its own time limit and a failed step does not
# stop the next one. A machine without the project's dependencies installs the wheels carried in .whl/
# (../shared/recipes/gpu-device.md).
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
LOG="$OUT/session.log"
WORK=$(mktemp -d)
PY=${PYTHON:-python3}
if [ -d .whl ] && ! "$PY" -c "import pydantic, pymetis" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site:$PWD/src"
fi
export PYTHONPATH="${PYTHONPATH:-$PWD/src}" PYTHONUNBUFFERED=1
PARTS=${*:-memory profile speed fp16}

say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }
# run LIMIT_S COMMAND...: the command with its output in the log, cut off after LIMIT_S seconds
run() { local limit=$1; shift; timeout "$limit" "$@" >>"$LOG" 2>&1; local rc=$?; echo "   exit $rc" >>"$LOG"; return $rc; }
ff() { run "$1" "$PY" -m flashflex_cli.cli "${@:2}"; }

if [ "${FLASHFLEX_SESSION_CPU:-0}" = 1 ]; then
  MODEL=llama-tiny; SEQ=64; BATCH=8; SIZES="1 2 4"; STEPS=3
  BIG=$WORK/small.json
  "$PY" - "$BIG" <<'EOF'
import json, sys
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.model.hf_config import to_hf_config
json.dump(to_hf_config(PRESETS["llama-small"]), open(sys.argv[1], "w"))
EOF
  ff 120 profile --synthetic 1x1xcpu --out "$WORK/node.json"
  SPEED=(--smoke); PROFILE_SIZES=1,2; DTYPE_ARGS=(--dtype fp32); RANKS_ARGS=(--cpu)
else
  MODEL=llama-1b; SEQ=2048; BATCH=16; SIZES="1 2 4 8"; STEPS=6
  # Llama 3.2 3B's shape (hidden 3072, 28 layers, 24 heads, 8 KV heads, feed-forward 8192, tied embeddings)
  BIG=$WORK/llama-3b.json
  cat >"$BIG" <<'EOF'
{"model_type": "llama", "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24,
 "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256, "rope_theta": 500000.0,
 "tie_word_embeddings": true, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072}
EOF
  ff 240 profile --out "$WORK/node.json"
  SPEED=(); PROFILE_SIZES=1,2,4; DTYPE_ARGS=(); RANKS_ARGS=()
fi
say "parts: $PARTS; model $MODEL seq $SEQ batch $BATCH; work $WORK"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1 || true

# launch_plan NAME PLAN_ARGS...: plan, then launch what the planner emits; a refused plan or a run that dies is kept
launch_plan() {
  local name=$1; shift
  local plan=$WORK/plan-$name.json run=$WORK/runs/$name
  if ! ff 300 plan "$WORK/node.json" --global-batch "$BATCH" --seq-len "$SEQ" --no-baseline --out "$plan" "$@"; then
    say "$name: refused by the planner (predicted not to fit)"; return
  fi
  if ! ff 420 launch "$plan" --cluster "$WORK/node.json" --steps "$STEPS" --out "$run" --overwrite --no-checkpoint; then
    mkdir -p "$run"; cp "$plan" "$run/plan.json"; cp "$WORK/node.json" "$run/cluster.json"
    tail -n 3 "$LOG" >"$run/FAILED.txt"; say "$name: the run failed (FAILED.txt)"
  else
    say "$name: ran"
  fi
}

# replay TAG ARGS...: validate_gpu_memory with ARGS (run folders, options), its figures to replay-TAG.txt
replay() {
  local tag=$1; shift
  "$PY" benchmarks/validate_gpu_memory.py "$@" >"$OUT/replay-$tag.txt" 2>&1
  cat "$OUT/replay-$tag.txt" >>"$LOG"
}

for part in $PARTS; do
  case $part in
    memory)
      for mbs in $SIZES; do say "memory: $MODEL micro-batch $mbs"; launch_plan "mb$mbs" -m "$MODEL" --micro-batch "$mbs" "${DTYPE_ARGS[@]}"; done
      say "memory: 3B-class shape, micro-batch searched"; launch_plan big -m "$BIG" --max-micro-batch 8 "${DTYPE_ARGS[@]}"
      say "memory: replay (the recorded runs and these)"; replay memory "$WORK"/runs/* ;;
    profile)
      say "profile: profile --model $MODEL"
      ff 420 profile --model "$MODEL" --seq-len "$SEQ" --micro-batch "$PROFILE_SIZES" --out "$OUT/gpu.layers.json" \
        "${DTYPE_ARGS[@]}"
      say "profile: replay of the $MODEL runs with the measured profile"
      replay profile --no-records --layers "$OUT/gpu.layers.json" "$WORK"/runs/mb* ;;
    speed)
      say "speed: bench_gpu_runtime"
      run 540 "$PY" benchmarks/bench_gpu_runtime.py "${SPEED[@]}" --trace "$OUT/bench_gpu_runtime-trace.txt" ;;
    ablations)
      say "ablations: bench_gpu_runtime --ablations"
      run 900 "$PY" benchmarks/bench_gpu_runtime.py "${SPEED[@]}" --ablations --skip-launch \
        --trace "$OUT/bench_gpu_runtime-ablations-trace.txt" ;;
    fp16)
      for dtype in bf16 fp16; do
        say "fp16: $MODEL in $dtype"; launch_plan "$dtype" -m "$MODEL" --micro-batch 2 --dtype "$dtype"
      done
      "$PY" - "$WORK/runs" >>"$LOG" 2>&1 <<'EOF'
import json, statistics, sys
from pathlib import Path
for run in sorted(Path(sys.argv[1]).glob("[bf][fp]16")):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"step"' in line]
    if rows:
        print(f"{run.name}: tokens/s {statistics.median(r['tokens_per_s'] for r in rows[1:] or rows):,.0f}, "
              f"losses {[round(r['loss'], 4) for r in rows]}, skipped {sum(bool(r.get('skipped')) for r in rows)}")
EOF
      ;;
    ranks)
      say "ranks: multi-rank plans on one GPU (--share-gpu), losses against one rank, memory per rank"
      run 3000 "$PY" benchmarks/ranks_session.py --work "$WORK/ranks" "${RANKS_ARGS[@]}"
      grep -E "^(ranks|validate_gpu_memory|ranks_session)|^    rank |^  [^ ].* step " "$LOG" >"$OUT/ranks.txt" || true ;;
    sharded)
      say "sharded: two ranks in DP on one GPU (--share-gpu), optimizer state sharded and not, memory per rank"
      run 1200 "$PY" benchmarks/ranks_session.py --sharded --work "$WORK/sharded" "${RANKS_ARGS[@]}"
      grep -E "^(ranks|validate_gpu_memory|ranks_session)|^    rank |^  [^ ].* step " "$LOG" >"$OUT/sharded.txt" || true ;;
    multigpu)
      gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
      if [ "${gpus:-0}" -lt 2 ]; then
        say "multigpu: ${gpus:-0} GPU(s): the CUDA-marked tests need two or more; skipped"
      elif ! "$PY" -c "import pytest" 2>/dev/null; then
        say "multigpu: pytest is not installed here; skipped"
      else
        say "multigpu: $gpus GPUs: the CUDA-marked tests"; run 900 "$PY" -m pytest -q -m cuda tests/test_multi_gpu.py
      fi ;;
    *) say "unknown part $part (memory, profile, speed, ablations, fp16, ranks, sharded, multigpu)" ;;
  esac
done
tar -czf "$OUT/runs.tar.gz" --exclude=ranks/ck -C "$WORK" $(cd "$WORK" && ls -d runs ranks sharded plan-*.json node.json 2>/dev/null) \
  2>/dev/null || true  # the ranks part's checkpoints stay behind: large, and only the resume needed them
say "done"

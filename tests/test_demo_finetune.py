"""`make demo-finetune`'s script: tiny local HF checkpoint -> fine-tune on the emulated cluster -> export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_finetune_script_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "ft"
    env = dict(os.environ, FT_OUT=str(out), FT_STEPS="4", FT_PLAN_BUDGET="2", FT_BATCH="4", FT_SEQ="32",
               FLASHFLEX=str(Path(sys.executable).with_name("flashflex")), PYTHON=sys.executable)
    done = subprocess.run(["bash", "scripts/demo_finetune.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 5))
    manifest = json.loads(next((out / "run" / "checkpoints").glob("step-*/manifest.json")).read_text())
    assert manifest["init_from"] == os.path.abspath(out / "hf-base")
    config = json.loads((out / "hf-finetuned" / "config.json").read_text())
    base = json.loads((out / "hf-base" / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert config[key] == base[key]
    assert (out / "hf-finetuned" / "model.safetensors").is_file()
    assert "loss on a sample sentence" in done.stderr or "tensors readable" in done.stderr

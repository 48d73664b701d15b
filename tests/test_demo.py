"""`make demo`'s script runs end to end (few steps) and the loss goes down."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_script_runs_end_to_end(tmp_path: Path) -> None:
    env = dict(os.environ, DEMO_OUT=str(tmp_path / "demo"), DEMO_STEPS="6",
               FLASHFLEX=str(Path(sys.executable).with_name("flashflex")), PYTHON=sys.executable)
    done = subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "demo" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 7))  # as the screen numbers them
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (tmp_path / "demo" / "plan.json").exists() and (tmp_path / "demo" / "local.json").exists()

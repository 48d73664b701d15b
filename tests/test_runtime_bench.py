"""The GPU runtime benchmark script stays runnable: it skips cleanly without CUDA and its --smoke mode runs
the same code paths (engine and plain loop) on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_runtime.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure")
def test_skips_without_cuda() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "SKIPPED: needs a CUDA GPU" in done.stderr and done.stdout == ""


@pytest.mark.slow
def test_smoke_run_prints_throughput_and_ratio() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("plain torch loop") for line in lines)
    engine = [line for line in lines if line.startswith("flashflex engine (sdpa)")]
    assert engine and "tokens/s" in engine[0] and "throughput vs plain loop" in engine[0]

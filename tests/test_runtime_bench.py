"""The GPU runtime benchmark script stays runnable: it skips cleanly without CUDA, its --smoke mode runs every
code path (the transformers loop eager and compiled, the engine compiled and with each path off, `flashflex
launch`) on the CPU, and its last line has the issue's exact format."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu_runtime.py"
LAST = re.compile(r"bench_gpu_runtime: flashflex/hf-compiled \d+\.\d\dx tokens/s, memory (\d+\.\d\dx|n/a)")


def _bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_gpu_runtime", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would measure")
def test_skips_without_cuda() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "SKIPPED: needs a CUDA GPU" in done.stderr and done.stdout == ""


def test_last_line_and_ratios() -> None:
    bench = _bench()
    assert bench.last_line(1.1449, 0.8751) == "bench_gpu_runtime: flashflex/hf-compiled 1.14x tokens/s, memory 0.88x"
    assert LAST.fullmatch(bench.last_line(0.76, 1.23)) and LAST.fullmatch(bench.last_line(2.0, None))
    fast, base = bench.Row("a", 0.5, 30 * 2**30), bench.Row("b", 1.0, 40 * 2**30)
    assert bench.ratios(fast, base) == (2.0, 0.75)
    assert bench.ratios(bench.Row("c", 2.0, None), base) == (0.5, None)


@pytest.mark.slow
def test_smoke_run_takes_every_path() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--ablations"], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    labels = ("hf eager", "hf compiled", "flashflex engine", "  --no-compile", "  --no-chunked-loss",
              "  --optimizer foreach", "  all three", "flashflex launch")
    for label in labels:
        rows = [line for line in lines if line.startswith(label) and "/hf-compiled" not in line]
        assert len(rows) == 1, label
        assert re.search(r"\d[\d,]* +\d+\.\d%", rows[0]) and re.search(r"\d+\.\d\dx", rows[0]), rows[0]
    engine = next(line for line in lines if line.startswith("flashflex engine"))
    assert not re.search(r"n/a +- ", engine)  # the engine reported its compile warm-up
    assert "compile=False" in next(line for line in lines if line.startswith("flashflex launch "))  # CPU default
    assert re.fullmatch(r"flashflex launch/hf-compiled \d+\.\d\dx tokens/s, memory n/a", lines[-2])
    assert any(line.startswith("host: ") and "load" in line for line in lines)
    assert LAST.fullmatch(lines[-1]), lines[-1]


def test_trace_writes_each_variants_top_kernels(tmp_path: Path, world_of_one: None) -> None:
    """--trace on the CPU (the smoke settings, a tiny model): after a variant is timed, one step under
    torch.profiler leaves its top operators (at most 40, most total time first) in the trace file."""
    bench_module = _bench()
    trace = tmp_path / "trace.txt"
    bench = bench_module.Bench(bench_module.parse(["--smoke", "--trace", str(trace), "--skip-launch"]))
    row = bench.measure("flashflex engine", lambda: bench.engine())
    assert row.step_s > 0
    bench.measure("  --no-chunked-loss", lambda: bench.engine(chunked_loss=False))
    sections = trace.read_text().strip().split("\n\n")
    assert [s.splitlines()[0].split(":")[0] for s in sections] == ["## flashflex engine", "## --no-chunked-loss"]
    for section in sections:
        rows = section.splitlines()[2:]
        assert 5 <= len(rows) <= bench_module.TRACE_ROWS
        times = [float(line.split()[0]) for line in rows]
        assert times == sorted(times, reverse=True) and times[0] > 0
    assert "aten::" in trace.read_text()  # CPU operators stand in for the kernels


def test_a_trace_file_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--trace", str(tmp_path / "no" / "t.txt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "does not exist" in done.stderr

"""The planning-time benchmark's fresh-interpreter modes stay runnable: --cold plans each repeat in a child
interpreter and reads its figures back, --against runs another copy of the package run for run and reports the ratio
(here the same package, so both plan the same layout)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_planning_time.py"


def _run(*extra: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), "--sizes", "8", "--classes", "none", "--jobs", "1",
                           "--repeats", "1", *extra], capture_output=True, text=True, timeout=300, check=True)
    return done.stdout


def _row(out: str) -> list[str]:
    return next(line for line in out.splitlines() if line.startswith("mixed-8 ")).split()


def test_cold_runs_plan_in_a_child_and_report_its_plan() -> None:
    cold, warm = _run("--cold"), _run()
    assert "each in a fresh interpreter" in cold and "in one interpreter" in warm
    assert float(_row(cold)[5]) > 0  # CPU seconds read back from the child
    assert _row(cold)[8:10] == _row(warm)[8:10]  # its candidates and predicted tokens/s: the plan planned in-process


def test_against_the_same_package_plans_the_same_layout() -> None:
    out = _run("--against", str(ROOT / "src"), "--shard-optimizer", "auto")
    this, other, ratio, same = _row(out)[1:5]
    assert float(this) > 0 and float(other) > 0
    low, high = (float(this) - 0.005) / (float(other) + 0.005), (float(this) + 0.005) / (float(other) - 0.005)
    assert low - 0.005 <= float(ratio) <= high + 0.005  # the ratio of the two (printed to 2 decimals)
    assert same == "True"
    assert re.search(r"against .*src", out)

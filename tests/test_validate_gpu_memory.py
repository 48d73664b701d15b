"""benchmarks/validate_gpu_memory.py on a multi-rank run folder: every rank's peak against its stage's prediction,
N counting ranks. The folder is written here (plan, cluster, metrics.jsonl with per-rank peaks), with measured
peaks set 2% above, 2% below and equal to the prediction, so the figures the script prints are known."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.cluster import save_cluster
from flashflex_cli.plan.schema import save_plan

from .test_share_gpu import GPU, gpu_plan

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "validate_gpu_memory.py"
FACTORS = [1.02, 0.98, 1.0]  # measured / predicted of ranks 0, 1, 2


def _run_folder(folder: Path) -> None:
    plan = gpu_plan()
    folder.mkdir()
    save_plan(folder / "plan.json", plan)
    save_cluster(folder / "cluster.json", GPU)
    (folder / "config.json").write_text(json.dumps({"share_gpu": True}))
    est = estimate(plan, GPU, CostParams())
    rows = []
    for step in range(3):
        stages = []
        for st in est.stages:
            ranks = [info.rank for info in plan.ranks() if (info.pipeline, info.stage) == (st.pipeline, st.stage)]
            peaks = [int(st.memory.allocated * FACTORS[r]) for r in ranks]
            stages.append({"pipeline": st.pipeline, "stage": st.stage, "forward_s": 0.01, "backward_s": 0.02,
                           "memory_bytes": max(peaks), "rank_memory_bytes": peaks})
        rows.append({"step": step, "loss": 5.0, "step_time_s": 0.5, "memory_bytes": 0, "stages": stages})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_every_rank_is_compared_and_counted(tmp_path: Path) -> None:
    _run_folder(tmp_path / "run")
    done = subprocess.run([sys.executable, str(SCRIPT), "--no-records", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # |1/1.02 - 1| = 1.96%, |1/0.98 - 1| = 2.04%, 0: median 1.96%, worst 2.04%
    assert re.fullmatch(r"validate_gpu_memory: 3 runs, memory median 2\.0%, worst 2\.0%, time median \d+\.\d%, "
                        r"oom-safe yes", lines[-1]), lines[-1]
    assert sum(line.lstrip().startswith("rank ") for line in lines) == 3
    assert any("(ranks share one GPU: no time target)" in line for line in lines)
    assert any("rank 1 (pipeline 0, stage 0)" in line and "+2.0%)" in line for line in lines)
    assert any("rank 0 (pipeline 0, stage 0)" in line and "-2.0%)" in line for line in lines)

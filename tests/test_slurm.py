"""The rendered sbatch scripts (a heterogeneous job, and a plain N-node allocation; 2 processes on one node, 1 on
the other) submitted to a real SLURM running on this machine complete and train. Needs root (to install and
start SLURM), else skips."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FLASHFLEX
from tests.infra.slurm import LocalSlurm, slurm_available

GOLDEN = Path(__file__).parent / "golden"

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports that were free a moment ago (all bound at once, then released), so a
    second test run beside this one does not pick the same rendezvous ports."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def _render(tmp_path: Path, name: str, port: int, *extra: str) -> Path:
    script = tmp_path / f"{name}.sbatch"
    rendered = subprocess.run(
        [FLASHFLEX, "launch", str(GOLDEN / "plan-3rank.json"), "--cluster", str(GOLDEN / "cluster-2node.json"),
         "--steps", "3", "--out", str(tmp_path / name), "--launcher", "slurm", "--torchrun",
         str(Path(sys.executable).with_name("torchrun")), "--script", str(script), "--port", str(port),
         "--timeout", "30", "--job-name", name, *extra],
        capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    return script


def test_rendered_sbatch_scripts_complete_on_a_real_slurm(tmp_path: Path) -> None:
    ok, why = slurm_available()
    if not ok:
        pytest.skip(why)
    het_port, plain_port = _free_ports(2)
    hetjob = _render(tmp_path, "het", het_port)  # default for nodes of 2 and 1 processes: a heterogeneous job
    plain = _render(tmp_path, "plain", plain_port, "--template", "slurm")  # one allocation, srun --relative=i
    assert "#SBATCH hetjob" in hetjob.read_text() and "#SBATCH hetjob" not in plain.read_text()
    for text in (hetjob.read_text(), plain.read_text()):
        assert "--nproc-per-node=2" in text and "--nproc-per-node=1" in text
    with LocalSlurm(cpus=2) as slurm:
        jobs = {name: slurm.submit(script, cwd=tmp_path) for name, script in (("het", hetjob), ("plain", plain))}
        for name, job in jobs.items():
            states = slurm.wait(job, timeout_s=150)
            log = "\n".join(p.read_text(errors="replace") for p in tmp_path.glob(f"flashflex-{job}*.out"))
            assert states and all(s == "COMPLETED" for s in states), f"{name} {states}\n{log[-4000:]}\n{slurm.logs()}"
            assert f"job {job}, rendezvous at 127.0.0.1:" in log
    for name in jobs:
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [1, 2, 3]
        assert {(s["pipeline"], s["stage"]) for s in rows[0]["stages"]} == {(0, 0), (0, 1), (1, 0)}

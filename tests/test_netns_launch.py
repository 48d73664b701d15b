"""A plan spanning two hosts (network namespaces), 3 processes on one and 1 on the other, launched through the
rendered torchrun commands, trains to the same losses as one process. Needs root and iproute2, else skips."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FLASHFLEX
from tests.infra.netns import NetnsHosts

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = str(GOLDEN / "cluster-2node.json")
STEPS = "4"

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_hosts(net: NetnsHosts, out: Path, run_id: str, env: dict[str, str] | None = None,
               timeout_s: float = 240) -> list[tuple[int, str]]:
    """Render the plan's torchrun commands for the namespace hosts and run line i on host i, all at once;
    returns (exit code, output) per host."""
    rendered = subprocess.run(
        [FLASHFLEX, "launch", str(GOLDEN / "plan-4rank.json"), "--cluster", CLUSTER, "--steps", STEPS,
         "--out", str(out), "--launcher", "torchrun", "--hosts", ",".join(h.addr for h in net.hosts),
         "--ifname", ",".join(h.ifname for h in net.hosts), "--run-id", run_id, "--timeout", "20",
         "--torchrun", str(Path(sys.executable).with_name("torchrun"))],
        capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    lines = [x for x in rendered.stdout.splitlines() if x.strip() and not x.startswith("#")]
    assert len(lines) == 2 and "--nproc-per-node=3" in lines[0] and "--nproc-per-node=1" in lines[1]
    procs = [subprocess.Popen([*net.prefix_cmd(i), "bash", "-c", line], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
             for i, line in enumerate(lines)]
    outputs = []
    try:
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(text)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [(proc.returncode, text) for proc, text in zip(procs, outputs, strict=True)]


def test_two_hosts_with_unlike_process_counts_match_one_process(net: NetnsHosts, tmp_path: Path) -> None:
    single = subprocess.run([FLASHFLEX, "launch", str(GOLDEN / "plan-1rank.json"), "--cluster", CLUSTER,
                             "--steps", STEPS, "--out", str(tmp_path / "one")], capture_output=True, text=True,
                            timeout=240)
    assert single.returncode == 0, single.stderr
    for code, text in _run_hosts(net, tmp_path / "two", "netns-ok"):
        assert code == 0, text[-3000:]
    two, one = _losses(tmp_path / "two"), _losses(tmp_path / "one")
    assert len(two) == int(STEPS)
    assert two == pytest.approx(one, rel=1e-5)


def test_a_rank_dying_on_one_host_ends_the_job_on_both(net: NetnsHosts, tmp_path: Path) -> None:
    # a hang instead of an exit fails by _run_hosts' timeout (subprocess.TimeoutExpired)
    (code0, text0), (code1, text1) = _run_hosts(net, tmp_path / "run", "netns-fail", timeout_s=150,
                                                env={"FLASHFLEX_FAULT_INJECT": "rank=2,step=2"})
    assert code1 != 0 and "fault injection: killing rank 2" in text1  # plan rank 2 is node1's only device
    assert code0 != 0  # the other host's ranks do not hang: they name themselves and the lost peer
    assert "flashflex worker rank 0 (node node0, device node0/0) lost a peer" in text0, text0[-3000:]

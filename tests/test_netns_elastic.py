"""Elastic multi-host runs (docs/elastic.md): a plan over two namespace hosts (3 processes + 1), launched through
the rendered `--elastic --launcher torchrun` commands; every process of the second host is killed mid-run, and
the job finishes on the first host under a plan re-made for it. Needs root and iproute2, else skips."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashflex_cli.plan.schema import load_plan
from flashflex_cli.semantics.run_folder import latest_rows
from tests.conftest import FLASHFLEX
from tests.infra.netns import NetnsHosts

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = str(GOLDEN / "cluster-2node.json")
STEPS = 12
HANG_GUARD_S = 240

pytestmark = [pytest.mark.slow, pytest.mark.root]


def _rows(run: Path) -> list[dict]:
    """The metrics rows, one per step: the last written (a step redone after a restart is appended again)."""
    try:
        return latest_rows([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                            if line.strip()])
    except (OSError, ValueError):
        return []


def _kill_host(net: NetnsHosts, i: int) -> None:
    """SIGKILL every process of namespace host i (its torchrun agent and its workers, each in its own session)."""
    pids = subprocess.run(["ip", "netns", "pids", net.hosts[i].name], capture_output=True, text=True,
                          timeout=30).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_killing_one_host_the_job_continues_on_the_other(net: NetnsHosts, tmp_path: Path) -> None:
    run, ck = tmp_path / "run", tmp_path / "ck"
    rendered = subprocess.run(
        [FLASHFLEX, "launch", str(GOLDEN / "plan-4rank.json"), "--cluster", CLUSTER, "--steps", str(STEPS),
         "--out", str(run), "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--elastic",
         "--max-restarts", "2", "--launcher", "torchrun", "--hosts", ",".join(h.addr for h in net.hosts),
         "--ifname", ",".join(h.ifname for h in net.hosts), "--run-id", "netns-elastic", "--timeout", "20",
         "--torchrun", str(Path(sys.executable).with_name("torchrun"))],
        capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    lines = [x for x in rendered.stdout.splitlines() if x.strip() and not x.startswith("#")]
    assert len(lines) == 2 and all("--nnodes=1:2" in x and "--max-restarts=2" in x for x in lines)
    assert all("-m flashflex_cli.launch.elastic_worker" in x for x in lines)
    logs = [tmp_path / f"host{i}.log" for i in range(2)]
    procs = []
    for i, line in enumerate(lines):
        with open(logs[i], "w") as handle:
            procs.append(subprocess.Popen([*net.prefix_cmd(i), "bash", "-c", line], stdout=handle,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while not any(row["step"] >= 4 for row in _rows(run)):
            assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        _kill_host(net, 1)  # the second host is gone: agent and workers
        procs[0].wait(timeout=HANG_GUARD_S)
    finally:
        for i, proc in enumerate(procs):
            if proc.poll() is None:
                _kill_host(net, i)
                proc.wait()
    text = logs[0].read_text()
    assert procs[0].returncode == 0, text[-4000:]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert events[-1]["present_nodes"] == ["node0"] and events[-1]["lost_devices"] == ["node1/0"]
    new_plan = load_plan(events[-1]["new_plan"])
    assert {info.device.rpartition("/")[0] for info in new_plan.ranks()} == {"node0"}
    assert "re-planned 4 ->" in text
    assert [row["step"] for row in _rows(run)] == list(range(1, STEPS + 1))
    assert load_plan(run / "plan.json") == new_plan

"""The search's process pool: results in order whatever the workers, byte-identical plans with 1 or N jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import TrainConfig
from flashflex_cli.planner.scoring.cost_cache import CostCache
from flashflex_cli.planner.search import SearchStats, plan_layout
from flashflex_cli.planner.search.pool import SearchPool, usable_cores
from flashflex_cli.planner.space.graph import DeviceGraph
from tests.conftest import REPO

MIXED = ("1x8xA100-80G-SXM:nic=ib:link=nvlink,1x8xRTX-4090:nic=eth,1x8xRTX-3090:nic=eth,"
         "1x8xA100-40G-SXM:nic=roce")


def _where(cache: CostCache, item: int) -> tuple[int, int, int]:
    """(item, item squared through the cache's graph size, the process that ran it)."""
    return item, item * item + cache.graph.size, os.getpid()


def _cache() -> CostCache:
    train = TrainConfig(global_batch=16, seq_len=128)
    return CostCache(DeviceGraph(build_cluster("1x2xcpu"), train.dtype), PRESETS["llama-tiny"], train, CostParams())


def test_map_keeps_the_order_and_runs_in_workers() -> None:
    cache = _cache()
    with SearchPool(cache, jobs=1) as pool:
        alone = pool.map(_where, range(20))
    assert {pid for _, _, pid in alone} == {os.getpid()}  # one job: in this process
    # Workers are forked only from a single-threaded process (planner/pool.py); earlier tests of a suite leave
    # threads in this one, so the two-job map runs in a fresh interpreter.
    code = ("import json, os; from tests.test_planner_pool import _cache, _where; "
            "from flashflex_cli.planner.search.pool import SearchPool\n"
            "with SearchPool(_cache(), jobs=2) as pool: spread = pool.map(_where, range(20))\n"
            "print(json.dumps({'spread': spread, 'pid': os.getpid()}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    spread = [tuple(r) for r in found["spread"]]
    assert [r[:2] for r in spread] == [r[:2] for r in alone] == [(i, i * i + 2) for i in range(20)]
    assert found["pid"] not in {pid for _, _, pid in spread}  # two jobs: in forked workers
    assert usable_cores() >= 1


@pytest.mark.parametrize(("spec", "model", "batch", "seq", "most"), [
    (MIXED, "llama2-7b", 64, 4096, 4),
    ("8x8xH100-SXM:nic=ib", "llama-tiny", 512, 512, None),  # the tail of pipeline counts: searched two at a time
])
def test_plans_are_byte_identical_with_one_or_two_workers(spec: str, model: str, batch: int, seq: int,
                                                          most: int | None) -> None:
    cluster = build_cluster(spec)
    train = TrainConfig(global_batch=batch, seq_len=seq)
    runs = []
    for jobs in (1, 2):
        stats = SearchStats()
        plan = plan_layout(cluster, PRESETS[model], train, time_budget_s=120, jobs=jobs, stats=stats,
                           max_micro_batch=most)
        runs.append((plan.to_json(), stats.candidates, stats.budget_hit))
    assert runs[0] == runs[1]
    assert not runs[0][2]

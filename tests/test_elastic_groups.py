"""Elastic runs of plans of replica groups (issue 32): a replica group lost whole is left out and the others
continue as they were (launch/group_loss.py); a group lost in part is re-planned, in replica groups where the fleet
has slow links (launch/elastic.replan with the run's rounds).

The plans are hand-written on tests/golden/cluster-2node.json with every slowdown 1 (node0/0-2, node1/0; its links
are all alike and slow, so every node is a site of its own to the planner). The real launch: llama-tiny in fp32,
three groups of one pipeline of one device each (node0/0, node0/1, node0/2) of 2, 4 and 2 inner steps per round;
every rank of group 1 is killed; the run continues from the checkpoint of step 4 with groups 0 and 2 (node0/2 is
node0/1 of the reduced cluster), in rounds of 2 steps. Time bounds are hang guards only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.cluster import Cluster, load_cluster
from flashflex_cli.launch.elastic import ElasticRun, Layout, reduced_cluster, replan
from flashflex_cli.launch.elastic_options import ElasticSettings
from flashflex_cli.launch.group_loss import (
    RunSteps,
    device_renames,
    group_loss_plan,
    lost_groups,
    without_groups,
)
from flashflex_cli.launch.local import JobOutcome, RankExit
from flashflex_cli.launch.options import launch_config
from flashflex_cli.plan.schema import Plan, load_plan
from flashflex_cli.plan.validate import check_plan
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.training.rounds import resumed_round
from flashflex_cli.semantics.run_folder import LATEST, latest_rows
from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
STEPS, EVERY = 12, 4  # whole rounds of the 3-group plan (4 steps) and of the 2-group plan left (2 steps)
HANG_GUARD_S = 240
# Loss tolerance, as tests/test_elastic.py's REL: the elastic relaunch and the resume by hand run the same plan
# from the same checkpoint with the same reduction order, so their losses should agree to the last bit;
# metrics.jsonl rounds them to 6 decimals (~2e-7 relative at a loss of ~5.5); 1e-5 is the parity tests' bound.
REL = 1e-5


def _cluster() -> Cluster:
    data = json.loads((GOLDEN / "cluster-2node.json").read_text())
    data["nodes"][0]["devices"][2]["slowdown"] = 1.0
    return Cluster.model_validate(data)


def _plan(cluster: Cluster, pipelines: list[list[str]], groups: list[tuple[list[int], int]],
          unused: tuple[str, ...] = (), micro_batches: int = 2, **outer: Any) -> Plan:
    """llama-tiny in fp32: one pipeline of one stage of all 4 layers per device list (TP over the list), one
    sequence per micro-batch; replica groups [(pipelines, inner_steps), ...]."""
    data = json.loads((GOLDEN / "plan-3rank.json").read_text())
    data["inputs"].update(cluster_sha256=cluster.sha256(), train={"global_batch": micro_batches * len(pipelines),
                                                                  "seq_len": 32, "dtype": "fp32"})
    data["pipelines"] = [{"micro_batch_size": 1, "num_micro_batches": micro_batches,
                          "stages": [{"devices": devices, "tp": len(devices), "layers": [0, 4]}]}
                         for devices in pipelines]
    data["unused_devices"] = [{"device": d, "reason": "left idle"} for d in unused]
    data["outer_sync"] = {"groups": [{"pipelines": p, "inner_steps": h} for p, h in groups],
                          "compression": "fp32", **outer}
    return Plan.model_validate(data)


def _three_groups(cluster: Cluster) -> Plan:
    """Groups of 1, 2 and 1 pipelines (node0/0 | node0/1, node0/2 | node1/0) of 2, 4 and 2 inner steps."""
    return _plan(cluster, [["node0/0"], ["node0/1"], ["node0/2"], ["node1/0"]], [([0], 2), ([1, 2], 4), ([3], 2)],
                 reason="planned across slow links")


# ---- the pure plan function ------------------------------------------------------------------------------------

def test_losing_a_whole_group_keeps_the_other_groups_as_they_were() -> None:
    cluster = _cluster()
    plan = _three_groups(cluster)
    lost = ["node0/1", "node0/2"]  # group 1, both its pipelines
    reduced = reduced_cluster(cluster, lost)
    found = group_loss_plan(plan, lost, cluster, reduced, CostParams())
    assert found is not None and found.groups == [1]
    new = found.plan
    assert new.outer_sync is not None
    assert [(g.pipelines, g.inner_steps) for g in new.outer_sync.groups] == [([0], 2), ([1], 2)]  # renumbered
    assert new.pipelines == [plan.pipelines[0], plan.pipelines[3]]  # stages, TP, layers, micro-batches as they were
    assert new.inputs.train.global_batch == 4 and plan.inputs.train.global_batch == 8
    assert new.inputs.train.model_copy(update={"global_batch": 8}) == plan.inputs.train
    assert (new.inputs.model, new.inputs.seed, new.inputs.strategy) == (plan.inputs.model, 0, "manual")
    assert new.inputs.cluster_sha256 == reduced.sha256()
    assert new.outer_sync.compression == "fp32" and "replica group(s) 1 lost" in (new.outer_sync.reason or "")
    checked = check_plan(new, reduced)
    assert checked.ok and not checked.warnings, checked  # every device of the reduced cluster is accounted for
    assert new.predicted is not None and new.predicted.tokens_per_s > 0
    assert new.predicted.outer_sync is not None  # a round's figures (cost/outer_sync.round_predicted)
    again = group_loss_plan(plan, list(reversed(lost)), cluster, reduced, CostParams())
    assert again is not None and again.plan.to_json() == new.to_json()  # deterministic, byte for byte


def test_devices_take_their_names_in_the_reduced_cluster() -> None:
    """Losing group 0 (node0/0): node0/1 and node0/2 are node0/0 and node0/1 of the reduced cluster."""
    cluster = _cluster()
    plan = _plan(cluster, [["node0/0"], ["node0/1"], ["node0/2"]], [([0], 2), ([1], 2), ([2], 2)],
                 unused=("node1/0",))
    reduced = reduced_cluster(cluster, ["node0/0"])
    renames = device_renames(cluster, ["node0/0"])
    assert renames == {"node0/1": "node0/0", "node0/2": "node0/1", "node1/0": "node1/0"}
    assert sorted(renames.values()) == sorted(reduced.device_ids)
    new = without_groups(plan, [0], renames, reduced)
    assert [r.device for r in new.ranks()] == ["node0/0", "node0/1"] and new.predicted is None
    assert [u.device for u in new.unused_devices] == ["node1/0"]
    assert check_plan(new, reduced).ok


def test_two_groups_losing_one_is_a_synchronous_plan() -> None:
    cluster = _cluster()
    plan = _plan(cluster, [["node0/0", "node0/1"], ["node1/0"]], [([0], 2), ([1], 2)], unused=("node0/2",))
    reduced = reduced_cluster(cluster, ["node0/0", "node0/1"])
    found = group_loss_plan(plan, ["node0/0", "node0/1"], cluster, reduced, CostParams())
    assert found is not None and found.groups == [0]
    new = found.plan
    assert new.outer_sync is None and "outer_sync" not in json.loads(new.to_json())
    assert new.pipelines == [plan.pipelines[1]] and new.inputs.train.global_batch == 2
    assert [u.device for u in new.unused_devices] == ["node0/0"]  # node0/2, renumbered
    assert new.predicted is not None and new.predicted.outer_sync is None and new.predicted.tokens_per_s > 0
    assert RunSteps(5, 1, 3).fits(new)  # a synchronous plan fits any step


def test_a_loss_that_is_not_of_whole_groups_is_left_to_the_replan() -> None:
    cluster = _cluster()
    plan = _three_groups(cluster)
    assert lost_groups(plan, ["node0/1"]) is None  # half of group 1
    assert lost_groups(plan, ["node0/1", "node0/2", "node0/0", "node1/0"]) is None  # every group
    assert lost_groups(plan, ["node0/0", "node0/1"]) is None  # group 0 and half of group 1
    assert lost_groups(plan, []) is None
    assert lost_groups(plan, ["node0/0", "node1/0"]) == [0, 2]
    synchronous = plan.model_copy(update={"outer_sync": None})
    assert lost_groups(synchronous, ["node0/0"]) is None
    reduced = reduced_cluster(cluster, ["node0/1"])
    assert group_loss_plan(plan, ["node0/1"], cluster, reduced, CostParams()) is None


def test_run_steps_fit_whole_rounds() -> None:
    plan = _three_groups(_cluster())  # rounds of 4 steps
    assert RunSteps(12, 4, 8).fits(plan) and RunSteps(12, 0, 0).fits(plan)
    assert not RunSteps(12, 2, 8).fits(plan) and not RunSteps(10, 4, 8).fits(plan)
    assert not RunSteps(12, 4, 6).fits(plan)


def test_a_resume_continues_at_the_same_run_step_when_rounds_change_length() -> None:
    assert resumed_round(3, 4, 12, 4) == 3  # the same rounds
    assert resumed_round(3, -1, 6, 4) == 3  # a checkpoint written before the round length was recorded
    assert resumed_round(2, 4, 8, 2) == 4  # a group of 4 inner steps left out: step 8 is round 4 of 2 steps
    assert resumed_round(-1, -1, 9, 2) == 4  # a synchronous checkpoint: the rounds its step holds
    with pytest.raises(Exception, match="no whole number of this plan's rounds of 3"):
        resumed_round(2, 4, 8, 3)


# ---- the elastic loop's decision -------------------------------------------------------------------------------

def _elastic(tmp_path: Path, plan: Plan, cluster: Cluster, steps: int, every: int) -> ElasticRun:
    tmp_path.mkdir()
    plan_file, cluster_file = tmp_path / "plan.json", tmp_path / "cluster.json"
    plan_file.write_text(plan.to_json())
    cluster_file.write_text(cluster.to_json())
    options = launch_config(plan=str(plan_file), cluster=str(cluster_file), out=str(tmp_path / "run"),
                            checkpoint_dir=str(tmp_path / "ck"), steps=steps, checkpoint_every=every)
    return ElasticRun(Layout(plan, str(plan_file), cluster, str(cluster_file)), options,
                      ElasticSettings(time_budget_s=10.0), (), lambda line: None)


def _killed(plan: Plan, devices: list[str]) -> JobOutcome:
    return JobOutcome(failures={r.rank: RankExit(r.rank, -9, 1.0) for r in plan.ranks() if r.device in devices})


def test_the_elastic_loop_leaves_out_whole_groups_and_replans_the_rest(tmp_path: Path) -> None:
    cluster = _cluster()
    plan = _three_groups(cluster)
    change = _elastic(tmp_path / "a", plan, cluster, 12, 4)._after_failure(_killed(plan, ["node0/1", "node0/2"]))
    assert (change.reason, change.groups, change.lost) == ("lost replica groups", [1], ["node0/1", "node0/2"])
    assert change.new.plan.outer_sync is not None and change.new.plan.world_size == 2
    # the groups left run rounds of 2 steps: --checkpoint-every 3 does not fit them, so the rest is re-planned
    change = _elastic(tmp_path / "b", plan, cluster, 12, 3)._after_failure(_killed(plan, ["node0/1", "node0/2"]))
    assert (change.reason, change.groups) == ("lost devices", [])
    assert change.new.plan.outer_sync is None  # no grouped re-plan fits rounds of 3 steps either


def test_a_group_lost_in_part_is_replanned_in_replica_groups_where_links_are_slow() -> None:
    cluster = _cluster()
    plan = _plan(cluster, [["node0/0"], ["node0/1"], ["node0/2"], ["node1/0"]], [([0, 1, 2], 4), ([3], 4)])
    reduced = reduced_cluster(cluster, ["node0/1"])
    new = replan(plan, reduced, "", CostParams(), 10.0, RunSteps(16, 4, 4))
    assert new.outer_sync is not None  # node0 and node1 are sites joined by a slow link: a group each
    assert RunSteps(16, 4, 4).fits(new) and new.inputs.train.global_batch == plan.inputs.train.global_batch
    sites = [{d.rpartition("/")[0] for p in g.pipelines for s in new.pipelines[p].stages for d in s.devices}
             for g in new.outer_sync.groups]
    assert sites == [{"node0"}, {"node1"}]
    assert check_plan(new, reduced).ok and new.predicted is not None and new.predicted.outer_sync is not None
    assert replan(plan, reduced, "", CostParams(), 10.0, RunSteps(6, 2, 2)).outer_sync is None  # rounds too long
    assert replan(plan, reduced, "", CostParams(), 10.0).outer_sync is None  # no run given: synchronous


# ---- a real launch -----------------------------------------------------------------------------------------------

def test_the_torchrun_round_of_the_hosts_left_keeps_their_groups(tmp_path: Path) -> None:
    """Global rank 0 of a rendered elastic torchrun job (launch/elastic_worker.decide_round), in a round without
    node0: the group on node0 is lost whole (node0/2, idle in the plan, does not matter), and the group on node1
    goes on alone, as the synchronous plan of its pipeline; without node1, node0's group goes on, its two pipelines
    as they were, in data parallel."""
    from flashflex_cli.hardware.cluster import save_cluster
    from flashflex_cli.launch.elastic_worker import decide_round
    from flashflex_cli.plan.schema import save_plan
    from flashflex_cli.run_config import load_run_config, save_run_config

    cluster = _cluster()
    plan = _plan(cluster, [["node0/0"], ["node0/1"], ["node1/0"]], [([0, 1], 2), ([2], 2)], unused=("node0/2",))
    cluster_path, plan_path = tmp_path / "cluster.json", tmp_path / "plan.json"
    save_cluster(cluster_path, cluster)
    save_plan(plan_path, plan)
    for present, kept in ((["node1"], [["node1/0"]]), (["node0"], [["node0/0"], ["node0/1"]])):
        run = tmp_path / f"run-{present[0]}"
        launched = launch_config(plan=str(plan_path), cluster=str(cluster_path), out=str(run),
                                 checkpoint_dir=str(tmp_path / f"ck-{present[0]}"), steps=STEPS,
                                 checkpoint_every=EVERY, lr=2e-3)
        written = load_run_config(decide_round(launched, str(save_run_config(launched)), present, 1))
        new = load_plan(written.plan)
        assert [stage.devices for pipe in new.pipelines for stage in pipe.stages] == kept
        [event] = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        assert event["reason"] == "lost replica groups" and event["lost_groups"] == ([0] if present == ["node1"]
                                                                                     else [1])
        # one group left: its pipelines trained synchronously
        assert new.outer_sync is None and new.inputs.train.global_batch == 2 * len(kept)
        assert check_plan(new, load_cluster(written.cluster)).ok


def _rows(run: Path) -> list[dict]:
    return latest_rows([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                        if line.strip()])


def _launch(plan: Path, cluster: Path, out: Path, ck: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return [FLASHFLEX, "launch", str(plan), "--cluster", str(cluster), "--out", str(out), "--steps", str(steps),
            "--schedule-steps", str(STEPS), "--checkpoint-dir", str(ck), "--checkpoint-every", str(EVERY),
            "--timeout", "20", *extra]


def _wait_for_checkpoint(proc: subprocess.Popen, ck: Path, step: int) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before the checkpoint"
        found = ckpt.latest_checkpoint(ck)
        if found is not None and found.name == f"step-{step:06d}":
            return
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint of step {step} within {HANG_GUARD_S} s")


@pytest.mark.slow
def test_a_lost_replica_group_is_left_out_and_the_others_continue(tmp_path: Path) -> None:
    cluster = _cluster()
    plan = _plan(cluster, [["node0/0"], ["node0/1"], ["node0/2"]], [([0], 2), ([1], 4), ([2], 2)],
                 unused=("node1/0",))
    plan_file, cluster_file = tmp_path / "plan.json", tmp_path / "cluster.json"
    plan_file.write_text(plan.to_json())
    cluster_file.write_text(cluster.to_json())
    run, ck, err = tmp_path / "run", tmp_path / "ck", tmp_path / "err.txt"
    # rank 2 (group 2) waits at the start of the round after the checkpoint of step 4, so the job holds still there
    # while group 1 is killed (the rank numbers of the relaunched plan stop at 1: it does not wait again)
    env = {**os.environ, "FLASHFLEX_DELAY_INJECT": "rank=2,seconds=60,step=4"}
    with open(err, "w") as handle:
        proc = subprocess.Popen(_launch(plan_file, cluster_file, run, ck, "--elastic"), stdout=subprocess.DEVNULL,
                                stderr=handle, start_new_session=True, env=env)
    try:
        _wait_for_checkpoint(proc, ck, 4)
        kept = tmp_path / "ck-by-hand"  # the same checkpoint, for the resume by hand below
        shutil.copytree(ck / "step-000004", kept / "step-000004")
        (kept / LATEST).write_text("step-000004")
        workers = json.loads((run / "workers.json").read_text())["workers"]
        os.kill(next(w["pid"] for w in workers if w["device"] == "node0/1"), signal.SIGKILL)  # all of group 1
        proc.wait(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = err.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    [event] = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert (event["reason"], event["lost_devices"], event["lost_groups"]) == ("lost replica groups", ["node0/1"], [1])
    assert (event["devices_before"], event["devices_after"], event["step"]) == (3, 2, 4)
    [line] = [line for line in stderr.splitlines() if line.startswith("elastic:")]
    assert "lost replica group 1 (node0/1); left out" in line and "3 -> 2 devices" in line
    assert "resuming from step 4" in line and "at step 4" in stderr  # the worker's "resumed from ... at step 4"
    new = load_plan(event["new_plan"])
    assert new.outer_sync is not None and [g.inner_steps for g in new.outer_sync.groups] == [2, 2]
    assert new.pipelines[0] == plan.pipelines[0] and [r.device for r in new.ranks()] == ["node0/0", "node0/1"]
    assert load_cluster(event["new_cluster"]).sha256() == new.inputs.cluster_sha256
    rows = _rows(run)
    assert [row["step"] for row in rows] == [4, 6, 8, 10, 12]  # the first round, then rounds of 2 steps
    assert ckpt.latest_checkpoint(ck).name == f"step-{STEPS:06d}"

    # the reduced plan resumed by hand from the same checkpoint
    ref = tmp_path / "ref"
    done = subprocess.run(_launch(Path(event["new_plan"]), Path(event["new_cluster"]), ref, kept, "--resume"),
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-3000:]
    reference = _rows(ref)
    assert [row["step"] for row in reference] == [6, 8, 10, 12]
    assert reference[0]["loss"] != reference[-1]["loss"]  # it trains: the comparison is not vacuous
    for mine, theirs in zip(rows[1:], reference, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=REL), mine["step"]


@pytest.mark.slow
def test_a_grouped_checkpoint_resumes_into_the_synchronous_plan_of_the_group_left(tmp_path: Path) -> None:
    """Two groups of 2 and 4 inner steps, one round (step 4); group 1 left out: group 0 alone is a synchronous
    plan, which resumes at the run's step 4 (not at group 0's 2 inner steps) and reads no outer entry."""
    cluster = _cluster()
    plan = _plan(cluster, [["node0/0"], ["node0/1"]], [([0], 2), ([1], 4)], unused=("node0/2", "node1/0"))
    reduced = reduced_cluster(cluster, ["node0/1"])
    found = group_loss_plan(plan, ["node0/1"], cluster, reduced, CostParams())
    assert found is not None and found.plan.outer_sync is None
    files = {name: tmp_path / f"{name}.json" for name in ("plan", "cluster", "plan1", "cluster1")}
    for name, text in (("plan", plan.to_json()), ("cluster", cluster.to_json()), ("plan1", found.plan.to_json()),
                       ("cluster1", reduced.to_json())):
        files[name].write_text(text)
    ck = tmp_path / "ck"
    first = subprocess.run(_launch(files["plan"], files["cluster"], tmp_path / "run", ck, steps=4),
                           capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert first.returncode == 0, first.stderr[-3000:]
    then = subprocess.run(_launch(files["plan1"], files["cluster1"], tmp_path / "run1", ck, "--resume",
                                  steps=6), capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert then.returncode == 0, then.stderr[-3000:]
    assert "step-000004 at step 4" in then.stderr
    assert [row["step"] for row in _rows(tmp_path / "run1")] == [5, 6]

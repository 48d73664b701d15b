"""Overlapped outer exchanges of low-communication training (Streaming DiLoCo, arXiv 2501.18512): the plan fields
`overlap_steps` (tau) and `merge_alpha`, several gloo processes on CPU in fp32.

(a) Plan: both fields are left out of the file at their defaults (plans written before them rewrite byte-identical),
    round-trip otherwise, impossible values are refused by name; `show` and `diff` name the overlap.
(b) Cost: one fragment's exchange overlapped by tau inner steps is charged max(0, outer - tau steps) exposed.
(c) Runtime: each exchange begins at its fragment's sync step and its collectives are waited for only after tau
    more inner steps (the handles stay pending across them); the global parameters (anchors) are bitwise the same
    on every rank after each outer step; the live parameters of the groups differ with alpha > 0; losses and the
    final global parameters match the single-process reference of the same schedule
    (reference_rounds(overlap=, alpha=)), also after a checkpoint (which first finishes the exchange in flight)
    resumed under another layout.

Tolerances: test_outer_sync_runtime's (1e-5 relative on losses, its parameter bound).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from rich.console import Console

from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.outer_sync import round_estimate
from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.plan.diff import diff_plans
from flashflex_cli.plan.predicted import Predicted
from flashflex_cli.plan.render import render_plan
from flashflex_cli.plan.schema import Plan
from flashflex_cli.planner.search.replica_groups import choose_sync
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import RankEngine
from flashflex_cli.runtime.training.reference_rounds import reference_rounds
from flashflex_cli.runtime.training.rounds import RoundTrainer
from flashflex_cli.semantics.outer_sync import group_inner_steps, group_pipelines, group_weights
from flashflex_cli.semantics.parameters import model_params
from tests.infra.worker_pool import WorkerPool, gloo_rank
from tests.test_outer_sync_plan import grouped_plan
from tests.test_outer_sync_runtime import (
    LAYOUT_A,
    LAYOUT_B,
    assert_params,
    assert_round_losses,
    group_batches,
    grouped,
    run_rounds,
    source_of,
)
from tests.test_parity import OPTIM, SEED

# LAYOUT_A's and LAYOUT_B's groups (3 and 2 sequences a step) with room for tau = 1 and 2 fragments: 4 and 5
# inner steps
GROUPS_A = [([0, 1], 4), ([2], 5)]
GROUPS_B = [([0], 4), ([1], 5)]


def overlapped(layout: list[Any], groups: list[tuple[list[int], int]], overlap: int, alpha: float = 0.0,
               fragments: int = 1, compression: str = "fp32") -> Plan:
    """test_outer_sync_runtime.grouped's plan with `fragments`, `overlap_steps` and `merge_alpha`."""
    data = json.loads(grouped(layout, groups, compression=compression).to_json())
    data["outer_sync"].update({"fragments": fragments, "overlap_steps": overlap, "merge_alpha": alpha})
    return Plan.model_validate(data)


# ---- (a) plan ------------------------------------------------------------------------------------------------

def test_defaults_stay_out_of_the_file_and_set_values_round_trip() -> None:
    plan = grouped_plan()
    text = plan.to_json()
    assert "overlap_steps" not in text and "merge_alpha" not in text
    assert plan.outer_sync is not None and (plan.outer_sync.overlap_steps, plan.outer_sync.merge_alpha) == (0, 0.0)
    data = json.loads(text)
    data["outer_sync"].update({"overlap_steps": 1, "merge_alpha": 0.5})
    again = Plan.model_validate(data)
    assert json.loads(again.to_json())["outer_sync"]["overlap_steps"] == 1
    assert Plan.model_validate_json(again.to_json()) == again


@pytest.mark.parametrize(("extra", "words"), [
    ({"overlap_steps": 3}, "overlap_steps 3 must be below group 1's inner_steps / fragments = 3/1"),
    ({"overlap_steps": 1, "fragments": 3}, "overlap_steps 1 must be below group 1's"),
    ({"overlap_steps": -1}, "overlap_steps"),
    ({"overlap_steps": 1.5}, "overlap_steps"),
    ({"overlap_steps": 1, "merge_alpha": 1.0}, "merge_alpha"),
    ({"overlap_steps": 1, "merge_alpha": -0.1}, "merge_alpha"),
    ({"merge_alpha": 0.5}, "merge_alpha 0.5 needs overlap_steps > 0"),
])
def test_impossible_overlaps_are_refused(extra: dict[str, Any], words: str) -> None:
    groups = {"groups": [{"pipelines": [0, 1], "inner_steps": 4}, {"pipelines": [2], "inner_steps": 3}]}
    with pytest.raises(ValidationError, match=words):
        grouped_plan({**groups, **extra})


def test_show_and_diff_name_the_overlap() -> None:
    plan = grouped_plan()
    data = json.loads(plan.to_json())
    data["outer_sync"].update({"overlap_steps": 2, "merge_alpha": 0.5})
    changed = Plan.model_validate(data)
    out = io.StringIO()
    render_plan(Console(file=out, width=300), changed)
    assert "each exchange overlapping 2 inner steps, merged with alpha 0.5" in out.getvalue()
    changes = diff_plans(plan, changed).changes
    assert any(line.startswith("outer sync:") and "overlapping 2 inner steps" in line for line in changes)


# ---- (b) cost ------------------------------------------------------------------------------------------------

def test_overlap_hides_tau_inner_steps_of_the_exchange() -> None:
    from tests.test_outer_sync_planning import SLOW, TRAIN, planner

    cluster = build_cluster(SLOW)
    synchronous = planner()(cluster, TRAIN)
    synchronous = synchronous.model_copy(update={"predicted": Predicted.model_validate(
        estimate(synchronous, cluster).to_predicted())})
    plain = choose_sync("local", synchronous, cluster, planner(), CostParams())
    assert plain.outer_sync is not None and plain.outer_sync.fragments == 1
    base = round_estimate(plain, cluster)
    data = json.loads(plain.to_json())
    data["outer_sync"]["overlap_steps"] = 1
    hidden = round_estimate(Plan.model_validate(data), cluster)
    step = next(t for t, h in zip(base.group_step_s, base.group_steps, strict=True) if t * h == base.inner_s)
    assert base.outer_exposed_s == base.outer_s  # without overlap the whole exchange is exposed
    assert hidden.outer_s == base.outer_s and hidden.inner_s == base.inner_s
    assert hidden.outer_exposed_s == pytest.approx(max(0.0, base.outer_s - step))
    assert hidden.round_s == pytest.approx(base.inner_s + hidden.outer_exposed_s) and hidden.round_s < base.round_s


# ---- (c) runtime ---------------------------------------------------------------------------------------------

def _worker(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, rounds: tuple[int, int],
            save_dir: str, resume: str) -> None:
    """Run rounds [rounds[0], rounds[1]) (resuming from `resume`, saving into `save_dir` when given), then finish the
    exchange in flight; record the losses, an event log ("train", ("begin", fragment), "wait", ("finish",
    fragment)), this rank's anchors of each finished fragment (name -> (tp, tp_rank, tensor)), its final anchors
    and full live parameters."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        groups = build_groups(plan, rank)
        engine = RankEngine(plan, rank, groups, torch.device("cpu"), OPTIM, seed=SEED + (1 if resume else 0))
        trainer = RoundTrainer(engine, source_of(plan))
        if resume:
            trainer.load_local(lambda targets: ckpt.load_into(resume, targets))
        outer = trainer.outer
        events: list[Any] = []
        finished: list[tuple[int, dict[str, tuple[int, int, torch.Tensor]]]] = []
        train_step, begin, finish, start = engine.train_step, outer.begin, outer.finish, outer._start

        class Handle:
            """A collective's handle that logs its wait."""

            def __init__(self, work: Any) -> None:
                self.work = work

            def wait(self) -> None:
                events.append("wait")
                self.work.wait()

        def anchors(fragment: int | None) -> dict[str, tuple[int, int, torch.Tensor]]:
            return {name: (groups.tp_size, groups.tp_rank, a.detach().clone()) for name, a in outer.anchors.items()
                    if fragment is None or outer.fragment_of[name] == fragment}

        def logged_train(*args: Any, **kwargs: Any) -> Any:
            events.append("train")
            return train_step(*args, **kwargs)

        def logged_begin(fragment: int | None = None) -> None:
            events.append(("begin", fragment))
            begin(fragment)

        def logged_finish(alpha: float = 0.0) -> None:
            fragment = outer.pending[0].fragment
            finish(alpha)
            events.append(("finish", fragment))
            finished.append((fragment, anchors(fragment)))

        def logged_start(*args: Any) -> Any:
            bucket = start(*args)
            bucket.handles = [Handle(h) for h in bucket.handles]
            return bucket

        engine.train_step = logged_train  # type: ignore[method-assign]
        outer.begin, outer.finish, outer._start = logged_begin, logged_finish, logged_start  # type: ignore[method-assign]
        losses = []
        for _ in range(*rounds):
            result = trainer.train_round()
            losses.append(([s.loss for s in result.steps], result.loss))
        in_flight = len(outer.pending)
        try:  # no checkpoint state with an exchange in flight
            outer.state()
            refused = False
        except RuntimeError:
            refused = True
        if save_dir:
            state = trainer.state_for_checkpoint()
            ckpt.save(save_dir, trainer.round * trainer.steps_per_round, state,
                      ckpt.shards_for(state, engine.shard_specs(), rank), {})
        trainer.flush()
        torch.save({"losses": losses, "events": events, "finished": finished, "anchors": anchors(None),
                    "params": engine.gather_full_params(), "pipeline": groups.pipeline, "round": trainer.round,
                    "in_flight": in_flight, "refused": refused}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """Five reusable worker processes (LAYOUT_A's ranks)."""
    with WorkerPool(5, _worker) as workers:
        yield workers


def assert_waits_after_tau_steps(events: list[Any], overlap: int) -> None:
    """Each exchange's collectives are waited for only after `overlap` inner steps of this rank past its begin
    (the last one's: after the run, by `flush`), and then its outer step is taken."""
    begins = [i for i, e in enumerate(events) if isinstance(e, tuple) and e[0] == "begin"]
    finishes = [i for i, e in enumerate(events) if isinstance(e, tuple) and e[0] == "finish"]
    assert len(begins) == len(finishes)
    trains = [i for i, e in enumerate(events) if e == "train"]
    for b, f in zip(begins, finishes, strict=True):
        assert events[b][1] == events[f][1]
        between = sum(1 for i in trains if b < i < f)
        assert between == overlap or (f > trains[-1] and between < overlap), events[b:f + 1]
        waits = [i for i in range(b, f) if events[i] == "wait"]
        assert all(i > trains[-1] or sum(1 for t in trains if b < t < i) == overlap for i in waits)


def assert_anchors_agree(outputs: list[dict[str, Any]], plan: Plan) -> None:
    """After every outer step every rank's anchors of the fragment equal rank 0's (it holds the whole model in
    LAYOUT_A) bitwise."""
    infos = {info.name: info for info in model_params(plan.inputs.model)}
    for rank, out in enumerate(outputs):
        assert [f for f, _ in out["finished"]] == [f for f, _ in outputs[0]["finished"]]
        for (_, shards), (_, full) in zip(out["finished"], outputs[0]["finished"], strict=True):
            for name, (tp, tp_rank, tensor) in shards.items():
                assert torch.equal(tensor, infos[name].take(full[name][2], tp, tp_rank)), f"rank {rank} {name}"


def check_reference(plan: Plan, outputs: list[dict[str, Any]], rounds: int, first: int = 0) -> None:
    """Inner and round losses, and every rank's final anchors, against the reference of the same schedule
    (resumed after round `first` when not 0)."""
    outer = plan.outer_sync
    assert outer is not None
    ref = reference_rounds(plan.inputs.model, group_batches(plan, rounds), group_weights(plan), OPTIM,
                           outer_lr=0.7, outer_momentum=0.9, seed=SEED, resumed_after=first or None,
                           fragments=outer.fragments, overlap=outer.overlap_steps, alpha=outer.merge_alpha)
    infos = {info.name: info for info in model_params(plan.inputs.model)}
    pipe_group = {p: g for g, pipes in enumerate(group_pipelines(plan)) for p in pipes}
    for rank, out in enumerate(outputs):
        g = pipe_group[out["pipeline"]]
        assert out["round"] == rounds
        assert_round_losses(plan, out["losses"], ref, g, first)
        for name, (tp, tp_rank, anchor) in out["anchors"].items():
            assert_params(f"rank {rank} {name}", anchor, infos[name].take(ref.params[name], tp, tp_rank),
                          max(group_inner_steps(plan)) * rounds)


@pytest.mark.slow
def test_overlapped_whole_model_matches_the_reference(tmp_path: Path, pool: WorkerPool) -> None:
    plan = overlapped(LAYOUT_A, GROUPS_A, overlap=1)
    outputs = run_rounds(plan, tmp_path, pool, (0, 2))
    for out in outputs:
        # round 1's exchange was still in flight after the last round: the outer state refused, flush finished it
        assert out["in_flight"] == 1 and out["refused"]
        assert_waits_after_tau_steps(out["events"], overlap=1)
        # round 0's exchange: begun after its last inner step, waited for and applied after round 1's first
        b, f = out["events"].index(("begin", 0)), out["events"].index(("finish", 0))
        steps = group_inner_steps(plan)[0 if out["pipeline"] < 2 else 1]
        assert out["events"][:b] == ["train"] * steps and out["events"][b + 1] == "train"
        assert set(out["events"][b + 2:f]) <= {"wait"}
    assert_anchors_agree(outputs, plan)
    check_reference(plan, outputs, rounds=2)
    for out in outputs:  # alpha 0: the live parameters are the global ones after the last merge
        for name, param in out["params"].items():
            assert torch.equal(param, outputs[0]["params"][name])


@pytest.mark.slow
def test_overlapped_fragments_with_mixing_match_the_reference(tmp_path: Path, pool: WorkerPool) -> None:
    plan = overlapped(LAYOUT_A, GROUPS_A, overlap=1, alpha=0.5, fragments=2)
    outputs = run_rounds(plan, tmp_path, pool, (0, 2))
    for out in outputs:
        assert_waits_after_tau_steps(out["events"], overlap=1)
        assert [f for f, _ in out["finished"]] == [0, 1, 0, 1]
    assert_anchors_agree(outputs, plan)
    check_reference(plan, outputs, rounds=2)
    # alpha > 0 keeps half of each group's local steps: the groups' live parameters differ, a group's agree
    pipe_group = {p: g for g, pipes in enumerate(group_pipelines(plan)) for p in pipes}
    by_group: dict[int, dict[str, torch.Tensor]] = {}
    for out in outputs:  # each rank's stage, TP-gathered
        mine = by_group.setdefault(pipe_group[out["pipeline"]], {})
        for name, param in out["params"].items():
            assert torch.equal(mine.setdefault(name, param), param), name
    assert any(not torch.equal(by_group[0][name], by_group[1][name]) for name in by_group[0])


@pytest.mark.slow
def test_overlapped_int8_exchange_agrees_on_every_rank(tmp_path: Path, pool: WorkerPool) -> None:
    plan = overlapped(LAYOUT_A, GROUPS_A, overlap=1, compression="int8")
    outputs = run_rounds(plan, tmp_path, pool, (0, 1))
    for out in outputs:
        assert_waits_after_tau_steps(out["events"], overlap=1)
    assert_anchors_agree(outputs, plan)


@pytest.mark.slow
def test_overlapped_checkpoint_resumes_under_another_layout(tmp_path: Path, pool: WorkerPool) -> None:
    plan_a = overlapped(LAYOUT_A, GROUPS_A, overlap=1, alpha=0.5, fragments=2)
    plan_b = overlapped(LAYOUT_B, GROUPS_B, overlap=1, alpha=0.5, fragments=2)
    saved = tmp_path / "ckpt"
    run_rounds(plan_a, tmp_path, pool, (0, 1), save=saved)
    found = ckpt.latest_checkpoint(saved)
    assert found is not None
    outputs = run_rounds(plan_b, tmp_path, pool, (1, 2), resume=found)
    check_reference(plan_b, outputs, rounds=2, first=1)


@pytest.mark.slow
def test_overlapped_rounds_launch_checkpoint_and_resume(tmp_path: Path) -> None:
    """`flashflex launch` of test_outer_sync_launch's plan with tau = 1 and alpha 0.5: the checkpoints at round ends
    (each finishing the exchange in flight) resume, and the run ends with no exchange in flight."""
    from tests.test_outer_sync_launch import grouped_plan as launch_plan
    from tests.test_outer_sync_launch import launch

    path = launch_plan(tmp_path)
    data = json.loads(path.read_text())
    data["outer_sync"].update({"overlap_steps": 1, "merge_alpha": 0.5})
    path.write_text(json.dumps(data))
    out = tmp_path / "run"
    done = launch(path, out, "--steps", "4", "--checkpoint-every", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    again = launch(path, out, "--steps", "6", "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stderr
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6

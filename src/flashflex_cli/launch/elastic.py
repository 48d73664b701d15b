"""Elastic local runs (`flashflex launch PLAN --elastic`): lost devices -> reduced cluster -> new plan -> relaunch.

The supervised local launcher (local.py) runs the plan. When the job ends with lost devices (a rank killed by
a signal nobody in the job sends, such as SIGKILL or SIGSEGV, or a rank found frozen: no heartbeat), this loop
writes the cluster without them (`RUN/elastic/cluster-N.json`), plans the same model and training
configuration on it with the planner (`RUN/elastic/plan-N.json`: same strategy, seed, layer profiles and
`--shard-optimizer` mode as the plan in force, whose `inputs` record them) and relaunches from the newest checkpoint with `--resume`: the run
configuration RUN/config.json is rewritten with the new plan and cluster and resume on (local.run_job). The global
batch is kept and the data order depends only on (seed, step), so step k trains on the same tokens under any
plan (runtime/training/data.py); the learning-rate schedule is kept too (--steps / --schedule-steps).

A plan of replica groups (`outer_sync`, semantics/outer_sync.py) that lost only whole groups, with a group left,
is not re-planned: the new plan is the old one without those groups (group_loss.py: the other groups keep their
pipelines, stages and inner steps; the global batch is what they train; one group left is a synchronous plan),
when its rounds divide --steps, --checkpoint-every and the resume step. Its event's reason is "lost replica
groups", with their indices in `lost_groups`. A group lost in part (or groups whose rounds do not fit) is
re-planned on the reduced cluster, in replica groups as `flashflex plan --sync local` makes them (H within the
old groups' inner steps) where the fleet has slow links to cut along and their rounds fit the run, else
synchronously. The torchrun path (elastic_worker.py) does the same for the hosts that left; the --cluster-watch
re-plan plans synchronously.

With `--cluster-watch FILE`, a change of FILE (cluster_watch.py) is planned at once; when the new plan's
predicted tokens/s beats the plan in force on that cluster by at least --replan-gain percent, every rank is
asked to stop at its next step boundary with a checkpoint (local.LocalJob.request_stop; only once training
began, so the stop is agreed by all ranks), and the job resumes under the new plan.

Every change is one console line and one JSON line in `RUN/events.jsonl`. A rank that fails with an error of its
own (an exception, a checkpoint write error, a changed token file) is no lost device: re-planning would not
help, and the job ends as without --elastic. So it does past --max-restarts, below --min-devices, or when no
plan fits the remaining devices: one line, exit 1, the newest checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..cost.params import CostParams
from ..errors import FlashflexError, InputError, RuntimeFailure
from ..fileio import atomic_write_text
from ..hardware.cluster import Cluster
from ..plan.schema import Plan, TrainConfig
from ..run_config import RunConfig
from ..semantics.outer_sync import group_inner_steps
from .cluster_watch import ClusterWatch
from .elastic_options import ElasticSettings, cost_params
from .failures import checkpoint_stamp, describe_local_failure
from .group_loss import RunSteps, group_loss_plan
from .local import JobOutcome, LocalJob, RankExit, interrupted, run_job

EVENTS_FILE = "events.jsonl"
ELASTIC_DIR = "elastic"
_STOP_SIGNALS = {int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)}


@dataclass
class Layout:
    """A plan in force, the cluster it was made for, and their files."""

    plan: Plan
    plan_path: str
    cluster: Cluster
    cluster_path: str


@dataclass
class Replan:
    """A decided change: the new layout, why, the devices lost (and the replica groups lost whole), and the
    predictions compared (tokens/s)."""

    new: Layout
    reason: str
    lost: list[str] = field(default_factory=list)
    before_tps: float | None = None
    after_tps: float | None = None
    groups: list[int] = field(default_factory=list)  # replica groups lost whole (launch/group_loss.py)


# ---- pure pieces ---------------------------------------------------------------------------------------------

def lost_devices(plan: Plan, failures: Mapping[int, RankExit]) -> list[str]:
    """Devices (plan order) of ranks that were lost: frozen, or killed by a signal the job does not send itself.
    Ranks that lost a peer, were stopped by the launcher or failed with an error of their own are not lost.
    Where a rank was killed, ranks that fell silent are waiting for it (blocked in a collective on a loaded
    host), not frozen: only the killed ones are lost then."""
    ranks = plan.ranks()
    killed, silent = [], []
    for rank, failure in sorted(failures.items()):
        code = int(failure.exitcode)
        if rank >= len(ranks):
            continue
        if code < 0 and -code not in _STOP_SIGNALS and not failure.stopped:
            killed.append(ranks[rank].device)
        elif failure.silent:
            silent.append(ranks[rank].device)
    return killed or silent


def reduced_cluster(cluster: Cluster, lost: list[str]) -> Cluster:
    """`cluster` without the devices `lost` ("NODE/INDEX"): a node's remaining devices are renumbered from 0
    (its measured intra-node pairs follow them), a node left empty is dropped with its inter-node pairs."""
    gone = set(lost)
    data = cluster.model_dump(mode="json", by_alias=True, exclude_none=True)
    nodes = []
    for node in data["nodes"]:
        keep = [i for i in range(len(node["devices"])) if f"{node['name']}/{i}" not in gone]
        if not keep:
            continue
        new_index = {old: new for new, old in enumerate(keep)}
        node["devices"] = [node["devices"][i] for i in keep]
        node["intra_pairs"] = [{**pair, "a": new_index[pair["a"]], "b": new_index[pair["b"]]}
                               for pair in node.get("intra_pairs", [])
                               if pair["a"] in new_index and pair["b"] in new_index]
        nodes.append(node)
    if not nodes:
        raise RuntimeFailure(f"every device of cluster {cluster.name!r} was lost")
    names = {node["name"] for node in nodes}
    inter = data.get("inter_node", {})
    inter["pairs"] = [p for p in inter.get("pairs", []) if p["a"] in names and p["b"] in names]
    data.update(nodes=nodes, inter_node=inter, description=f"{cluster.name} without {', '.join(lost)}")
    return Cluster.model_validate(data)


def predicted_tokens_per_s(plan: Plan, cluster: Cluster, params: CostParams) -> float | None:
    """The cost model's tokens/s for `plan` on `cluster` (None: it cannot run there); a round's for replica
    groups (cost/outer_sync.py)."""
    from ..cost.reestimate import validate_plan

    checked = validate_plan(plan, cluster, params)
    if not checked.ok or checked.estimate is None:
        return None
    if plan.outer_sync is not None:
        from ..cost.outer_sync import round_estimate

        return float(round_estimate(plan, cluster, params).tokens_per_s)
    return float(checked.estimate.tokens_per_s)


def replan_micro_batch(old: Plan) -> tuple[int, int | None]:
    """The micro-batch sizes (sequences) a re-plan of `old` may use, as `plan_layout`'s (micro_batch,
    max_micro_batch): the one size every pipeline of `old` runs, pinned; pipelines of several sizes let the
    search choose from the smallest of them up to the largest."""
    sizes = sorted({pipe.micro_batch_size for pipe in old.pipelines})
    return (sizes[0], None) if len(sizes) == 1 else (sizes[0], sizes[-1])


def replan_sharding(old: Plan) -> str:
    """The `--shard-optimizer` mode a re-plan of `old` searches with: the one its inputs record; else auto (the
    planner's default) for a plan the planner made, and for a hand-written plan what it does (on: it shards)."""
    from ..planner.search import STRATEGIES

    if old.inputs.shard_optimizer is not None:
        return old.inputs.shard_optimizer
    if old.inputs.strategy in STRATEGIES:
        return "auto"
    return "on" if old.optimizer_sharding is not None else "off"


def replan(old: Plan, cluster: Cluster, cluster_path: str, params: CostParams, time_budget_s: float,
           rounds: RunSteps | None = None) -> Plan:
    """A plan of `old`'s model and training configuration for `cluster`, with `old`'s strategy ("flashflex" for a
    hand-made plan), seed and optimizer sharding decision (`replan_sharding`, recorded in the new plan's inputs:
    a later re-plan decides the same way); InfeasibleError when none fits. With `rounds` (the run it continues) a
    plan of replica groups is re-planned in replica groups where it can (`regrouped`)."""
    from ..cost.estimate import estimate
    from ..cost.reestimate import reestimated
    from ..planner.search import STRATEGIES, plan_layout, searches_of
    from ..planner.search.sharding import choose_sharding

    inputs = old.inputs
    strategy = inputs.strategy if inputs.strategy in STRATEGIES else "flashflex"
    micro_batch, max_micro_batch = replan_micro_batch(old)
    mode = replan_sharding(old)

    options: dict[str, Any] = {"strategy": strategy, "time_budget_s": time_budget_s, "seed": inputs.seed,
                               "params": params, "micro_batch": micro_batch, "max_micro_batch": max_micro_batch}

    def plan_on(sub: Cluster, train: TrainConfig) -> Plan:
        return plan_layout(sub, inputs.model, train, **options)

    plan, _ = choose_sharding(searches_of(cluster, inputs.model, inputs.train, **options), mode, params)
    plan = reestimated(plan, estimate(plan, cluster, params))
    if old.outer_sync is not None and rounds is not None:
        plan = regrouped(old, plan, cluster, plan_on, params, rounds)
    return plan.model_copy(update={"inputs": plan.inputs.model_copy(update={
        "cluster_path": cluster_path, "runtime": inputs.runtime,
        "shard_optimizer": None if mode == "auto" else mode})})


def regrouped(old: Plan, synchronous: Plan, cluster: Cluster, plan_site: Callable[[Cluster, TrainConfig], Plan],
              params: CostParams, rounds: RunSteps) -> Plan:
    """`synchronous` (the re-plan of `old`, a plan of replica groups, for `cluster`) as replica groups, as
    `flashflex plan --sync local` makes them (planner/search/replica_groups.choose_sync) with H in the range of
    `old`'s inner steps (a plan does not record the range it was planned with); `synchronous` where the fleet has
    no slow link to cut along or the groups' rounds do not fit the run (`rounds`)."""
    from ..planner.search.replica_groups import choose_sync

    steps = group_inner_steps(old)
    try:
        grouped = choose_sync("local", synchronous, cluster, plan_site, params, (min(steps), max(steps)))
    except InputError:
        return synchronous
    return grouped if rounds.fits(grouped) else synchronous


def plan_after_loss(plan: Plan, lost: list[str], cluster: Cluster, reduced: Cluster, cluster_path: str,
                    params: CostParams, time_budget_s: float, rounds: RunSteps) -> tuple[Plan, list[int]]:
    """The plan that continues `plan` on `reduced` (`cluster` without the devices `lost`), and the replica groups
    it leaves out: the other groups as they were when whole groups were lost and their rounds fit the run
    (`group_loss.group_loss_plan`), else a re-plan with no group left out (`replan`; FlashflexError when none
    fits). `cluster_path` is recorded in the plan's inputs either way."""
    shrunk = group_loss_plan(plan, lost, cluster, reduced, params)
    if shrunk is not None and rounds.fits(shrunk.plan):
        inputs = shrunk.plan.inputs.model_copy(update={"cluster_path": cluster_path})
        return shrunk.plan.model_copy(update={"inputs": inputs}), shrunk.groups
    return replan(plan, reduced, cluster_path, params, time_budget_s, rounds), []


def latest_step(checkpoint_dir: str | None) -> int:
    """The step of the newest complete checkpoint (0: none)."""
    if checkpoint_dir is None:
        return 0
    from ..semantics.run_folder import latest_checkpoint, read_manifest

    found = latest_checkpoint(checkpoint_dir)
    if found is None:
        return 0
    try:
        return int(read_manifest(found)["step"])
    except (FlashflexError, KeyError, TypeError, ValueError):
        return 0


def append_event(run_dir: str, event: dict[str, Any]) -> Path:
    """Add one JSON line to RUN/events.jsonl (the whole file rewritten atomically: never half a line)."""
    path = Path(run_dir) / EVENTS_FILE
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    return atomic_write_text(path, old + json.dumps(event) + "\n")


def _tps_text(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f}"


def _checkpoint_text(checkpoint_dir: str | None) -> str:
    step = latest_step(checkpoint_dir)
    if not step:
        return "no checkpoint was written yet"
    return f"the checkpoint of step {step} in {checkpoint_dir} is intact (continue with --resume)"


# ---- the watch hook --------------------------------------------------------------------------------------------

class WatchHook:
    """Polled by the local launcher (local.run_job): plans each change of the watched cluster file and, when it
    pays, asks the job to stop at its next step boundary once training has begun."""

    def __init__(self, watch: ClusterWatch, current: Layout, params: CostParams, settings: ElasticSettings,
                 run_dir: str, start_step: int, say: Callable[[str], None]) -> None:
        self.watch, self.current, self.params, self.settings = watch, current, params, settings
        self.metrics = Path(run_dir) / "metrics.jsonl"
        self.start_step, self.say = start_step, say
        self.pending: Replan | None = None

    def __call__(self, job: LocalJob) -> None:
        if self.pending is None:
            cluster = self.watch.poll()
            if cluster is None:
                return
            self.pending = self.decide(cluster)
        if self.pending is not None and not job.stop_requested and self._training():
            job.request_stop()

    def decide(self, cluster: Cluster) -> Replan | None:
        """The re-plan for the watched `cluster` when its predicted gain reaches --replan-gain, else None."""
        path = str(self.watch.path)
        try:
            plan = replan(self.current.plan, cluster, path, self.params, self.settings.time_budget_s)
        except FlashflexError as exc:
            self.say(f"cluster-watch: {path} changed, no plan fits it ({exc}); continuing under the current plan")
            return None
        before = predicted_tokens_per_s(self.current.plan, cluster, self.params)
        after = float(plan.predicted.tokens_per_s) if plan.predicted else 0.0
        gain = None if not before else 100.0 * (after / before - 1.0)
        if gain is not None and gain < self.settings.replan_gain_pct:
            self.say(f"cluster-watch: {path} changed: a new plan predicts {_tps_text(after)} tokens/s against "
                     f"{_tps_text(before)} now ({gain:+.1f}%, below --replan-gain {self.settings.replan_gain_pct:g}%)"
                     "; continuing under the current plan")
            return None
        return Replan(Layout(plan, "", cluster, path), "cluster changed", [], before, after)

    def _training(self) -> bool:
        """True once this attempt recorded a step (every rank has joined training: a stop is then collective)."""
        try:
            lines = self.metrics.read_text(encoding="utf-8").splitlines()
        except OSError:
            return False
        for line in reversed(lines):
            try:
                if int(json.loads(line)["step"]) >= self.start_step:
                    return True
            except (ValueError, KeyError, TypeError):
                continue
        return False


# ---- the loop ----------------------------------------------------------------------------------------------------

class ElasticRun:
    """One elastic launch: the layout in force, the restarts used, the files written."""

    def __init__(self, layout: Layout, options: RunConfig, settings: ElasticSettings,
                 inherit_fds: tuple[int, ...], say: Callable[[str], None]) -> None:
        if options.checkpoint_dir is None:
            raise InputError("--elastic needs checkpoints, not --no-checkpoint (a lost device is survived from the "
                             "last checkpoint)")
        self.layout, self.options, self.settings = layout, options, settings
        self.inherit_fds, self.say = inherit_fds, say
        self.params = cost_params(layout.plan, settings.layers)
        self.restarts = 0
        self.changes = 0
        self.watch = ClusterWatch(settings.cluster_watch, say) if settings.cluster_watch else None

    def run(self) -> None:
        """Run, re-plan and relaunch until the steps are done; raises RuntimeFailure (exit 1) or Interrupted."""
        before = checkpoint_stamp(self.options.checkpoint_dir)
        options = self.options
        while True:
            start = latest_step(options.checkpoint_dir) if options.resume else 0
            hook = None
            if self.watch is not None:
                hook = WatchHook(self.watch, self.layout, self.params, self.settings, options.out, start, self.say)
            outcome = run_job(self.layout.plan, options, inherit_fds=self.inherit_fds, hook=hook)
            if outcome.signals:
                raise interrupted(outcome, options, before)
            # the next attempt continues this launch: from the newest checkpoint, or from step 0 when there is
            # none (a checkpoint the folders held before this launch was continued by it or cleared by --overwrite)
            resume = True
            step = latest_step(options.checkpoint_dir)
            if outcome.failures:
                change = self._after_failure(outcome)
            elif outcome.stopped and hook is not None and hook.pending is not None and step < options.steps:
                change = hook.pending
            else:
                return
            self._apply(change, step)
            options = dataclasses.replace(self.options, plan=self.layout.plan_path,
                                          cluster=self.layout.cluster_path, resume=resume)

    def _after_failure(self, outcome: JobOutcome) -> Replan:
        """The re-plan after a failed job, or the RuntimeFailure that ends the run."""
        plan, ckpt = self.layout.plan, self.options.checkpoint_dir
        cause = describe_local_failure(plan, self.layout.cluster, outcome.failures, self.options.out)
        lost = lost_devices(plan, outcome.failures)
        if not lost:
            raise cause
        if self.restarts >= self.settings.max_restarts:
            raise RuntimeFailure(f"{cause}; --max-restarts {self.settings.max_restarts} used up, stopping: "
                                 f"{_checkpoint_text(ckpt)}")
        cluster = reduced_cluster(self.layout.cluster, lost)
        left = len(cluster.device_ids)
        if left < self.settings.min_devices:
            raise RuntimeFailure(f"lost {', '.join(lost)}: {left} device(s) left, below --min-devices "
                                 f"{self.settings.min_devices}; stopping: {_checkpoint_text(ckpt)}")
        rounds = RunSteps(self.options.steps, self.options.checkpoint_every, latest_step(ckpt))
        try:
            new, groups = plan_after_loss(plan, lost, self.layout.cluster, cluster, "", self.params,
                                          self.settings.time_budget_s, rounds)
        except FlashflexError as exc:
            raise RuntimeFailure(f"lost {', '.join(lost)}: no plan of {plan.inputs.model.name} fits the {left} "
                                 f"remaining device(s) ({exc}); stopping: {_checkpoint_text(ckpt)}") from None
        reason = "lost replica groups" if groups else "lost devices"
        self.restarts += 1
        before = predicted_tokens_per_s(plan, self.layout.cluster, self.params)
        after = float(new.predicted.tokens_per_s) if new.predicted else 0.0
        return Replan(Layout(new, "", cluster, ""), reason, lost, before, after, groups)

    def _file(self, kind: str, index: int) -> str:
        return os.path.join(self.options.out, ELASTIC_DIR, f"{kind}-{index}.json")

    def _apply(self, change: Replan, step: int) -> None:
        """Write the new cluster and plan files (a watched cluster is copied: the run does not depend on the
        watched file staying as it was), the event and the console line; switch to the new layout."""
        self.changes += 1
        old, new = self.layout, change.new
        new.cluster_path = self._file("cluster", self.changes)
        new.plan_path = self._file("plan", self.changes)
        new.plan = new.plan.model_copy(update={"inputs": new.plan.inputs.model_copy(
            update={"cluster_path": new.cluster_path})})
        atomic_write_text(new.cluster_path, new.cluster.to_json())
        atomic_write_text(new.plan_path, new.plan.to_json())
        event = {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), "step": step,
                 "reason": change.reason, "lost_devices": change.lost, "lost_groups": change.groups,
                 "devices_before": old.plan.world_size, "devices_after": new.plan.world_size,
                 "old_plan": old.plan_path, "new_plan": new.plan_path,
                 "old_cluster": old.cluster_path, "new_cluster": new.cluster_path,
                 "watched": self.settings.cluster_watch if change.reason == "cluster changed" else None,
                 "predicted_tokens_per_s_before": change.before_tps,
                 "predicted_tokens_per_s_after": change.after_tps}
        append_event(self.options.out, event)
        what = f"lost {', '.join(change.lost)}" if change.lost else f"{self.settings.cluster_watch} changed"
        how = "re-planned "
        if change.groups:
            what = (f"lost replica group{'s' if len(change.groups) > 1 else ''} "
                    f"{', '.join(map(str, change.groups))} ({', '.join(change.lost)})")
            how = "left out, the other groups as they were: "
        self.say(f"elastic: {what}; {how}{old.plan.world_size} -> {new.plan.world_size} devices, predicted "
                 f"{_tps_text(change.before_tps)} -> {_tps_text(change.after_tps)} tokens/s ({new.plan_path}); "
                 f"resuming from step {step}")
        self.layout = new


def run_elastic(plan: Plan, options: RunConfig, settings: ElasticSettings, inherit_fds: tuple[int, ...],
                say: Callable[[str], None]) -> None:
    """Run `plan` (its cluster file: options.cluster) elastically; returns when every step is trained."""
    from ..hardware.cluster import load_cluster

    layout = Layout(plan, options.plan, load_cluster(options.cluster), options.cluster)
    ElasticRun(layout, options, settings, inherit_fds, say).run()

"""Training in rounds for a plan of replica groups (low-communication training, semantics/outer_sync.py).

One round on one rank: its group's `inner_steps` ordinary steps of the engine (gradients reduced inside the
group only), each on its pipeline's rows of the round's data (`semantics/outer_sync.round_rows`; the data
source's batch is a whole round, `round_sequences` sequences), then the outer step across every group
(runtime/parallel/outer_sync.py); with streamed fragments, fragment f's outer step instead follows inner step
`fragment_sync_step(inner_steps, f, fragments)` (semantics/outer_sync.py). The round's loss is the token-weighted
mean of the groups' mean inner losses, the same on every rank.

Overlap (`overlap_steps` tau > 0, Streaming DiLoCo arXiv 2501.18512): at its sync step a fragment's exchange only
begins; the group trains tau more inner steps, then waits for it, takes the outer step and merges (parameter =
alpha * local + (1 - alpha) * global, alpha = `merge_alpha`). The last fragment syncs at the round's end, so its
exchange is carried into the next round and finished after that round's inner step tau (carrying, rather than
making it synchronous, keeps the whole model's exchange hidden when fragments = 1, plain DiLoCo); the plan's
tau < inner_steps / fragments makes every other exchange end inside its round, before the next one begins.
`flush` finishes what is in flight (after the last round; `state_for_checkpoint` calls it).

Checkpoints (taken at round ends, where every group holds the global parameters; with overlap the exchange in
flight is finished first, so its merge falls at the round's end rather than tau steps later): the engine's state
plus "<name>.outer_momentum", "outer_round" and "outer_round_steps" (the steps a round advances the run by), with
"step" the run's step (`RoundTrainer.state_for_checkpoint`); the inner AdamW moments saved are group 0's
(engine.plan_shard_specs). With streamed fragments the fragments but the last are mid-way between
their outer steps at a round's end (and with merge_alpha > 0 no parameter equals its global one): the checkpoint
adds their global parameters ("<name>.outer_anchor") and its parameters are group 0's local ones, which every group
resumes from (as from group 0's moments). `load_local` resumes from a checkpoint of any plan, synchronous or
grouped (a synchronous one has no outer momentum: it starts at zero, the round from its step count; one of rounds
of another length, a replica group left out by an elastic run, continues at the same run step: `resumed_round`);
every group of the new plan starts from the saved moments, with its own update count for their bias correction. A
synchronous plan resumes from a grouped checkpoint too (the engine reads no outer entry; "step" is the run's):
with streamed fragments it takes group 0's local parameters, as every group would.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ...errors import InputError
from ...semantics.outer_sync import (
    fragment_sync_step,
    group_inner_steps,
    group_of_pipeline,
    group_ranks,
    group_round_sequences,
    group_weights,
    plan_fragments,
    round_rows,
)
from ..parallel.outer_sync import ANCHOR_SUFFIX, MOMENTUM_SUFFIX, ROUND_KEY, OuterSync
from ..parallel.shards import ShardSpec
from .data import BatchSource, stage_tokens
from .engine import RankEngine, StepResult
from .optimizer import restore_moments

ROUND_STEPS_KEY = "outer_round_steps"  # checkpoint entry: the saving plan's steps per round (int64)


@dataclass(frozen=True)
class RoundResult:
    """One round: `loss` the token-weighted mean of every group's mean inner loss (same on every rank),
    `group_loss` this rank's group's mean inner loss, `steps` its inner steps' results, `tokens` the round's
    tokens over all groups, `outer_s` seconds of the outer step on this rank and `outer_comm_s` of its
    collectives, `outer_bytes` payload bytes this rank all-reduced in it."""

    loss: float
    group_loss: float
    steps: list[StepResult] = field(default_factory=list)
    tokens: int = 0
    outer_s: float = 0.0
    outer_comm_s: float = 0.0
    outer_bytes: int = 0


def resumed_round(saved_round: int, saved_stride: int, saved_step: int, stride: int) -> int:
    """The round a plan of `stride` steps per round resumes at from a checkpoint of round `saved_round` whose
    plan's rounds were `saved_stride` steps (-1: not recorded, taken as `stride`): the same round, or the same run
    step when the round's length changed (a replica group was left out, launch/group_loss.py; InputError when that
    step is no whole number of this plan's rounds). A synchronous checkpoint (`saved_round` -1, of run step
    `saved_step`): the rounds its step holds."""
    if saved_round < 0:
        return saved_step // stride
    if saved_stride in (-1, stride):
        return saved_round
    step = saved_round * saved_stride
    if step % stride:
        raise InputError(f"the checkpoint of step {step} is no whole number of this plan's rounds of {stride} inner "
                         "steps: resume it under a plan whose rounds divide the step")
    return step // stride


class RoundTrainer:
    """Rounds of `engine`'s plan (which has an `outer_sync` section) on data `source` (a batch per round:
    int64 [round_sequences, seq_len + 1])."""

    def __init__(self, engine: RankEngine, source: BatchSource) -> None:
        self.engine, self.source, self.plan = engine, source, engine.plan
        self.outer = OuterSync(self.plan, engine.params, engine.groups)
        self.group = group_of_pipeline(self.plan, engine.groups.pipeline)
        self.inner_steps = group_inner_steps(self.plan)[self.group]
        self.steps_per_round = max(group_inner_steps(self.plan))  # the run's step count advances by this a round
        # the lowest rank of each group adds its group's weighted loss to the round's loss
        self.reports_loss = engine.groups.rank == group_ranks(self.plan)[self.group][0]
        self.weight = group_weights(self.plan)[self.group]
        self.round_tokens = sum(group_round_sequences(self.plan)) * self.plan.inputs.train.seq_len
        fragments = plan_fragments(self.plan)
        # the fragments whose outer step follows each inner step (0-based), in fragment order
        self.syncs: dict[int, list[int]] = {}
        for f in range(fragments):
            self.syncs.setdefault(fragment_sync_step(self.inner_steps, f, fragments) - 1, []).append(f)
        self.overlap, self.alpha = self.plan.outer_sync.overlap_steps, self.plan.outer_sync.merge_alpha
        # this group's inner step (0-based, counted over the run) after which each exchange in flight finishes
        self.due: deque[int] = deque()

    @property
    def round(self) -> int:
        """Rounds taken."""
        return self.outer.round

    def train_round(self, record_ops: bool = False) -> RoundResult:
        """One round (collective over the group for the inner steps, over the job for the outer step)."""
        engine, index = self.engine, self.outer.round
        steps = []
        outer_s, comm, sent = 0.0, self.outer.comm_seconds, self.outer.bytes_sent
        for k in range(self.inner_steps):
            rows = round_rows(self.plan, engine.groups.pipeline, index, k)
            batch = stage_tokens(self.source, index, rows.as_slice(), engine.first or engine.last)
            steps.append(engine.train_step(batch, record_ops=record_ops))
            done = index * self.inner_steps + k
            start = time.perf_counter()
            while self.due and self.due[0] <= done:  # overlapped exchanges whose tau steps have run
                self.due.popleft()
                self.outer.finish(self.alpha)
            for fragment in self.syncs.get(k, []):
                if self.overlap == 0:
                    self.outer.step(fragment)
                else:
                    self.outer.begin(fragment)
                    self.due.append(done + self.overlap)
            outer_s += time.perf_counter() - start
        group_loss = sum(s.loss for s in steps) / len(steps)
        total = torch.tensor([self.weight * group_loss if self.reports_loss else 0.0], dtype=torch.float64)
        dist.all_reduce(total, group=engine.groups.job_group)
        return RoundResult(loss=float(total.item()), group_loss=group_loss, steps=steps, tokens=self.round_tokens,
                           outer_s=outer_s, outer_comm_s=self.outer.comm_seconds - comm,
                           outer_bytes=self.outer.bytes_sent - sent)

    def flush(self) -> None:
        """Finish every overlapped exchange in flight now (its outer step and merge), collective over the job: after
        the last round, and before a checkpoint (which must not be taken with an exchange in flight)."""
        self.outer.flush(self.alpha)
        self.due.clear()

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """The engine's entries (parameters are the global ones at a round's end) and the outer state, after
        finishing any exchange in flight (`flush`); "step" is the run's step (rounds x `steps_per_round`, what a
        synchronous plan resumes at) and ROUND_STEPS_KEY the steps per round."""
        self.flush()
        return {**self.engine.state_for_checkpoint(), **self.outer.state(),
                "step": torch.tensor(self.round * self.steps_per_round, dtype=torch.int64),
                ROUND_STEPS_KEY: torch.tensor(self.steps_per_round, dtype=torch.int64)}

    def load_local(self, fill: Callable[[dict[str, tuple[ShardSpec, torch.Tensor]]], None]) -> None:
        """Resume in place from a checkpoint of any plan (`fill` as `RankEngine.load_local` takes it)."""
        momenta: dict[str, torch.Tensor] = {}
        anchors: dict[str, torch.Tensor] = {}
        extra: dict[str, tuple[ShardSpec, torch.Tensor]] = {}
        for spec in self.engine.shard_specs():
            local = self.engine.params[spec.name][1].detach()
            wanted = [(MOMENTUM_SUFFIX, momenta, torch.zeros_like(local))]
            if self.outer.saves_anchors:  # NaN: a checkpoint without anchors (its parameters are the global ones)
                wanted.append((ANCHOR_SUFFIX, anchors, torch.full_like(local, float("nan"))))
            for suffix, into, buffer in wanted:
                into[spec.name] = buffer
                key = f"{spec.name}{suffix}"
                extra[key] = (replace(spec, name=key, optional=True), buffer)
        saved_round = torch.full((), -1, dtype=torch.int64)  # -1: a checkpoint without outer state
        saved_stride = torch.full((), -1, dtype=torch.int64)  # -1: one written before the key (or synchronous)
        for key, tensor in ((ROUND_KEY, saved_round), (ROUND_STEPS_KEY, saved_stride)):
            extra[key] = (ShardSpec(key, (), None, 0, 1, self.engine.rank == 0, optional=True), tensor)
        self.engine.load_local(lambda targets: fill({**targets, **extra}))
        index = resumed_round(int(saved_round.item()), int(saved_stride.item()), self.engine.step,
                              self.steps_per_round)
        # every group continues its own schedule from the round count (its inner steps per round); the AdamW
        # moments are group 0's (plan_shard_specs), their bias correction this group's own update count
        steps = index * self.inner_steps
        self.engine.step = self.engine.optimizer_steps = steps
        for param in (p for _, p in self.engine.params.values()):
            state = self.engine.optimizer.state.get(param, {})
            if steps > 0 and "exp_avg" in state:
                restore_moments(self.engine.optimizer, param, steps, state["exp_avg"], state["exp_avg_sq"])
        self.outer.load(momenta, index, {name: a for name, a in anchors.items() if not a.isnan().all()})

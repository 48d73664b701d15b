"""Low-communication training (the DiLoCo family): the round schedule the cost model and the runtime both read.

A plan with an `outer_sync` section splits its pipelines into replica groups: consecutive runs of pipelines,
each a full asymmetric plan over its part of the fleet. Inside a group, training is today's synchronous data
parallelism (gradients reduced across the group's pipelines only). Every round, group g runs
`inner_steps[g]` inner optimizer steps on its own data, then all groups take one outer step together:
pseudo-gradient = global parameters - local parameters (DiLoCo, arXiv 2311.08105, Algorithm 1), averaged over
the groups weighted by the tokens each processed in the round, applied to the global parameters by SGD with
Nesterov momentum; every group then continues from the new global parameters.

Data of a round (`round_rows`): round r is one "batch" of `round_sequences` sequences of the data source; group
g's inner step k, pipeline p takes the consecutive rows starting at
`group_row_offset(g) + k * group_sequences(g) + (rows of the group's earlier pipelines)`, so no two groups, steps or
pipelines read the same row and a round consumes exactly the tokens it is charged for.

Streamed fragments (Streaming DiLoCo, arXiv 2501.18512; `outer_sync.fragments` F > 1): the model's layers split
into F consecutive blocks (`fragment_layers`: floor splits; the embedding goes with fragment 0, the final norm and
head with fragment F-1: `param_fragment`). Each fragment keeps its own global parameters and takes its own outer
step once a round, after inner step `fragment_sync_step(H, f, F)` of a group of H inner steps (ceil((f+1) H / F):
fragment f's sync lags fragment 0's by about f H / F inner steps, fragment F-1 syncs at the round's end, so each
fragment is still synced every H steps but every exchange moves about 1/F of the pseudo-gradient). Fragments sync
in the order 0..F-1 on every group (several may sync after the same inner step), so the exchanges match up across
groups of different inner step counts. F = 1 is the whole model at the round's end.

Duck-typed over the plan (this part may not import the plan format): `plan.pipelines[p].sequences`,
`plan.pipelines[p].stages[s].tp`, `plan.outer_sync` (None, or `.groups[g].pipelines` and `.groups[g].inner_steps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# outer optimizer defaults from the literature (DiLoCo, arXiv 2311.08105, section 3: Nesterov, lr 0.7, momentum 0.9)
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
# bytes per element of a pseudo-gradient on the wire, by compression dtype
COMPRESSION_BYTES = {"fp32": 4, "bf16": 2, "int8": 1}
# int8 pseudo-gradients: elements sharing one fp32 scale (runtime/parallel/outer_sync.py quantizes per block)
INT8_BLOCK = 1024


def grouped(plan: Any) -> bool:
    """True when the plan trains in replica groups joined by outer steps (it has an `outer_sync` section)."""
    return getattr(plan, "outer_sync", None) is not None


def group_pipelines(plan: Any) -> list[list[int]]:
    """Pipeline indices of each replica group; a plan without `outer_sync` is one group of every pipeline."""
    if not grouped(plan):
        return [list(range(len(plan.pipelines)))]
    return [list(group.pipelines) for group in plan.outer_sync.groups]


def group_inner_steps(plan: Any) -> list[int]:
    """Inner steps per round of each group ([1] without `outer_sync`: every step is a synchronous step)."""
    if not grouped(plan):
        return [1]
    return [int(group.inner_steps) for group in plan.outer_sync.groups]


def pipeline_ranks(plan: Any) -> list[list[int]]:
    """The global ranks of each pipeline (pipelines, then stages, then TP ranks)."""
    out: list[list[int]] = []
    rank = 0
    for pipe in plan.pipelines:
        width = sum(stage.tp for stage in pipe.stages)
        out.append(list(range(rank, rank + width)))
        rank += width
    return out


def group_ranks(plan: Any) -> list[tuple[int, ...]]:
    """The global ranks of each replica group, sorted."""
    per_pipe = pipeline_ranks(plan)
    return [tuple(sorted(r for p in pipes for r in per_pipe[p])) for pipes in group_pipelines(plan)]


def group_of_pipeline(plan: Any, pipeline: int) -> int:
    """The replica group holding `pipeline`."""
    return next(g for g, pipes in enumerate(group_pipelines(plan)) if pipeline in pipes)


def group_sequences(plan: Any, group: int) -> int:
    """Sequences group `group` processes per inner step (its pipelines' batch shares)."""
    return sum(plan.pipelines[p].sequences for p in group_pipelines(plan)[group])


def group_round_sequences(plan: Any) -> list[int]:
    """Sequences each group processes in one round (inner steps x sequences per inner step)."""
    return [steps * group_sequences(plan, g) for g, steps in enumerate(group_inner_steps(plan))]


def round_sequences(plan: Any) -> int:
    """Sequences all groups process in one round together (the data source's batch per round)."""
    return sum(group_round_sequences(plan))


def group_weights(plan: Any) -> list[float]:
    """Each group's share of the round's tokens: the weight of its pseudo-gradient in the outer average (sums
    to 1)."""
    per_group = group_round_sequences(plan)
    total = sum(per_group)
    return [n / total for n in per_group]


def group_row_offset(plan: Any, group: int) -> int:
    """The first row of group `group`'s share of a round's data (rows of the groups before it)."""
    return sum(group_round_sequences(plan)[:group])


@dataclass(frozen=True)
class RoundRows:
    """Where one pipeline's batch of one inner step lies in a round's data: `round` (the data source's step
    index) and the rows [start, stop)."""

    round: int
    start: int
    stop: int

    def as_slice(self) -> slice:
        """The rows as a slice."""
        return slice(self.start, self.stop)


def round_rows(plan: Any, pipeline: int, round_index: int, inner_step: int) -> RoundRows:
    """The rows pipeline `pipeline` reads at inner step `inner_step` (0-based within its group's round) of round
    `round_index` (module docstring)."""
    group = group_of_pipeline(plan, pipeline)
    steps = group_inner_steps(plan)[group]
    if not 0 <= inner_step < steps:
        raise ValueError(f"inner step {inner_step} outside group {group}'s {steps} steps per round")
    start = group_row_offset(plan, group) + inner_step * group_sequences(plan, group)
    for p in group_pipelines(plan)[group]:
        if p == pipeline:
            break
        start += plan.pipelines[p].sequences
    return RoundRows(round_index, start, start + plan.pipelines[pipeline].sequences)


def pseudo_gradient_bytes(parameters: int, compression: str) -> int:
    """Bytes of one full pseudo-gradient of `parameters` elements on the wire in `compression`."""
    return parameters * COMPRESSION_BYTES[compression]


def fragment_layers(num_layers: int, fragments: int) -> list[tuple[int, int]]:
    """The layers [start, stop) of each of `fragments` streamed fragments (consecutive floor splits)."""
    if not 1 <= fragments <= num_layers:
        raise ValueError(f"{fragments} fragments of {num_layers} layers")
    return [(num_layers * f // fragments, num_layers * (f + 1) // fragments) for f in range(fragments)]


def param_fragment(name: str, num_layers: int, fragments: int) -> int:
    """The fragment of global parameter `name`: its layer's ("layers.<i>.…"); "embed" fragment 0; the rest (final
    norm, head) the last fragment."""
    if name == "embed":
        return 0
    if not name.startswith("layers."):
        return fragments - 1
    layer = int(name.split(".")[1])
    return next(f for f, (start, stop) in enumerate(fragment_layers(num_layers, fragments)) if start <= layer < stop)


def fragment_sync_step(inner_steps: int, fragment: int, fragments: int) -> int:
    """The inner step (1-based, within the round) of a group of `inner_steps` per round after which fragment
    `fragment` of `fragments` takes its outer step: ceil((fragment + 1) * inner_steps / fragments), in [1,
    inner_steps]; `inner_steps` for the last fragment."""
    return -(-(fragment + 1) * inner_steps // fragments)


def plan_fragments(plan: Any) -> int:
    """Streamed fragments of the plan (1 without `outer_sync`)."""
    return int(plan.outer_sync.fragments) if grouped(plan) else 1


def exchange_bytes(elements: int, compression: str, holders: int) -> float:
    """Bytes of an all-reduce with the same ring time as the outer exchange of `elements` pseudo-gradient elements
    among `holders` ranks: the all-reduce itself in fp32 or bf16; int8 all-gathers every holder's payload and fp32
    scales (B = elements + 4 ceil(elements / INT8_BLOCK) bytes each), (n-1) B per ring link, as an all-reduce of
    n B / 2 bytes moves."""
    if compression != "int8":
        return float(pseudo_gradient_bytes(elements, compression))
    return (elements + 4 * -(-elements // INT8_BLOCK)) * max(1.0, holders / 2)

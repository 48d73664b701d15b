"""Whether a plan shards its optimizer state (`flashflex plan --shard-optimizer auto|on|off`), and how.

A sharded optimizer (semantics/optimizer_shards.py) leaves each device the AdamW moments of its own pieces of the
slices it shares with other pipelines: 8 bytes per parameter become 8 / holders, so stages fit more layers and
more, shallower pipelines fit. The search itself is the same; its memory check charges each stage 1 / ways of its
optimizer state (`plan_layout(optimizer_shard_ways=ways)`), and the finalists are ranked by `estimate` with their
exact shards. Shard sizes follow what each device can afford: its memory left after its stage without optimizer
state (`stage_room`, `weigh`), equal shards where those do not fit.

- off: the search without sharding (plans as before);
- on: the best of the sharded searches (`ways_to_try`: two searches, from the unsharded plan's replica count to
  four times it);
- auto (the default): the search without sharding, and the sharded ones where the optimizer state is a real
  share of the fullest stage's memory (`WORTH_TRYING`) or nothing fits without; a sharded plan wins when it
  is predicted faster by more than the cost model's median error (semantics/stated_error.py), or nothing fits
  without it.
Planning time: auto costs nothing more where sharding is not worth trying, one sharded search (a band of replica
counts, without refinement or the device-subset phase) where it is.
Either way one line says what was chosen and why, with the predicted gain over the same search without sharding.
"""

from __future__ import annotations

from collections.abc import Callable

from ...cost.estimate import Estimate, estimate
from ...cost.memory import device_capacity, stage_params_per_device
from ...cost.params import CostParams
from ...errors import FlashflexError, InfeasibleError, InputError
from ...plan.schema import OptimizerSharding, Plan
from ...semantics.stated_error import MEDIAN_STEP_ERROR
from ..scoring.cost_cache import CostCache

MODES = ("auto", "on", "off")
WAYS = (2, 4, 8)  # holders the sharded searches assume per slice
WORTH_TRYING = 0.15  # auto: shard when the optimizer state is at least this share of the fullest stage's memory
MIB = 2**20


def stage_room(cache: CostCache, plan: Plan) -> dict[tuple[int, int], float]:
    """Per (pipeline, stage): the bytes its tightest device has left after the stage without its optimizer state,
    from the search's own (memoised) stage memory."""
    out = {}
    for p, pipe in enumerate(plan.pipelines):
        count = len(pipe.stages)
        for s, stage in enumerate(pipe.stages):
            memory = cache.stage_bytes_breakdown(stage.tp, stage.num_layers, s == 0, s == count - 1,
                                                 min(count - s, pipe.num_micro_batches))
            slack = memory.fragmentation / memory.allocated if memory.allocated else 0.0
            capacity = min(device_capacity(cache.graph.cluster, d, cache.params) for d in stage.devices)
            out[(p, s)] = capacity - (memory.total - memory.optimizer * (1.0 + slack))
    return out


def weigh(plan: Plan, room: dict[tuple[int, int], float]) -> Plan:
    """`plan` with shard weights per rank: the MiB its stage has left without optimizer state (`stage_room`),
    at least 1."""
    weights = [max(1, int(room[(info.pipeline, info.stage)] // MIB)) for info in plan.ranks()]
    reason = plan.optimizer_sharding.reason if plan.optimizer_sharding is not None else None
    return plan.model_copy(update={"optimizer_sharding": OptimizerSharding(weights=weights, reason=reason)})


def best_weighting(plan: Plan, cache: CostCache) -> tuple[Plan, Estimate]:
    """A sharded `plan` (equal shards) with the weights that fit: by memory left where that fits, else equal."""
    weighted = weigh(plan, stage_room(cache, plan))
    est = estimate(weighted, cache.graph.cluster, cache.params)
    if est.fits:
        return weighted, est
    return plan, estimate(plan, cache.graph.cluster, cache.params)


def optimizer_share(plan: Plan, params: CostParams) -> float:
    """The largest share of a stage's predicted memory (`predicted.stages[].memory_bytes`) that its AdamW
    moments take (0 without predictions)."""
    model, share = plan.inputs.model, 0.0
    for stage in (plan.predicted or {}).get("stages", []):
        pipe = plan.pipelines[stage["pipeline"]]
        st, count = pipe.stages[stage["stage"]], len(pipe.stages)
        held = sum(stage_params_per_device(model, st.tp, st.num_layers, stage["stage"] == 0,
                                           stage["stage"] == count - 1))
        if stage.get("memory_bytes"):
            share = max(share, params.optimizer_state_bytes * held / stage["memory_bytes"])
    return share


def ways_to_try(plain: Plan | None) -> tuple[int, ...]:
    """The sharded searches worth running; each charges every stage 1 / ways of its optimizer state and searches
    replica counts in [ways, 2 ways), so the charge is never below a layout's real share. The first at the
    unsharded plan's replica count (at least 2: the same count with the memory sharding frees, up to twice as
    many replicas), the second at twice that (auto runs the first only); `WAYS` when nothing fits unsharded."""
    if plain is None:
        return WAYS
    first = max(2, len(plain.pipelines))
    return first, 2 * first


def _summary(plan: Plan) -> str:
    pipes = len(plan.pipelines)
    deepest = max(len(p.stages) for p in plan.pipelines)
    return f"{pipes} pipeline{'s' if pipes != 1 else ''}, up to {deepest} stages"


def choose_sharding(plan_with: Callable[[int], Plan], mode: str, params: CostParams) -> tuple[Plan, str]:
    """The plan for `mode` (module docstring) and one line on why. `plan_with(ways)`: the search's plan charging
    1 / ways of the optimizer state (1: unsharded), with `predicted` filled; InfeasibleError when none fits."""
    if mode not in MODES:
        raise InputError(f"--shard-optimizer must be one of {', '.join(MODES)}, got {mode!r}")
    plain: Plan | None = None
    plain_error: FlashflexError | None = None
    try:
        plain = plan_with(1)
    except InfeasibleError as exc:
        if mode == "off":
            raise
        plain_error = exc
    if mode == "off":
        assert plain is not None
        return plain, "optimizer state not sharded (--shard-optimizer off)"
    if mode == "auto" and plain is not None:
        share = optimizer_share(plain, params)
        if share < WORTH_TRYING:
            return plain, (f"optimizer state not sharded: it is {share:.0%} of the fullest stage's memory "
                           f"(sharding is tried from {WORTH_TRYING:.0%})")
    found: list[tuple[float, int, Plan]] = []
    tried = ways_to_try(plain)
    for ways in tried[:1] if mode == "auto" and plain is not None else tried:
        try:
            candidate = plan_with(ways)
        except InfeasibleError:
            continue
        tokens = float((candidate.predicted or {}).get("tokens_per_s", 0.0))
        found.append((tokens, -ways, candidate))
    plain_tokens = float((plain.predicted or {}).get("tokens_per_s", 0.0)) if plain is not None else 0.0
    if not found:
        if plain is None:
            assert plain_error is not None
            raise plain_error
        return plain, "optimizer state not sharded: no sharded layout fits"
    tokens, _, best = max(found, key=lambda item: (item[0], item[1]))
    if mode == "auto" and plain is not None and tokens < plain_tokens * (1.0 + MEDIAN_STEP_ERROR):
        return plain, (f"optimizer state not sharded: the best sharded plan predicts {tokens:,.0f} tokens/s "
                       f"({_summary(best)}), without sharding {plain_tokens:,.0f} ({_summary(plain)}), "
                       f"{tokens / plain_tokens - 1:+.0%}: auto shards for more than the cost model's median error "
                       f"({MEDIAN_STEP_ERROR:.0%}; --shard-optimizer on to shard)")
    if plain is None:
        why = f"sharded: {tokens:,.0f} tokens/s predicted ({_summary(best)}); nothing fits without sharding"
    else:
        why = (f"sharded: {tokens:,.0f} tokens/s predicted ({_summary(best)}) against {plain_tokens:,.0f} without "
               f"sharding ({_summary(plain)}), {tokens / plain_tokens - 1:+.0%}")
    assert best.optimizer_sharding is not None
    sharding = best.optimizer_sharding.model_copy(update={"reason": why})
    return best.model_copy(update={"optimizer_sharding": sharding}), why

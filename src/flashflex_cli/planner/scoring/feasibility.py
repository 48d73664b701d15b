"""Up-front infeasibility checks: one line naming what is needed against what there is (exit 2)."""

from __future__ import annotations

from collections.abc import Iterable

from ...errors import InfeasibleError
from ...units import byte_size
from ..space.tp_groups import tp_degrees
from .cost_cache import CostCache


def model_state_bytes(cache: CostCache) -> float:
    """Bytes of weights, gradients and optimizer state of the whole model (fp32 parameters and gradients,
    AdamW's moments)."""
    full = cache.stage_bytes_breakdown(1, cache.model.num_layers, True, True, 0)
    return 2 * full.weights + full.optimizer


def usable_bytes(cache: CostCache, devices: Iterable[int] | None = None) -> float:
    """Sum over `devices` (default every device) of capacity less the per-device reserve (bytes)."""
    reserve = cache.params.memory_reserve_bytes
    return sum(cache.capacity((i,)) - reserve for i in (range(cache.graph.size) if devices is None else devices))


def holds_model_state(cache: CostCache, devices: Iterable[int]) -> bool:
    """True when `devices` together have the memory for the model's weights, gradients and optimizer state (a
    necessary condition for any pipeline of them to fit)."""
    return usable_bytes(cache, devices) >= model_state_bytes(cache)


def check_feasible(cache: CostCache, total_micro: int) -> None:
    """Raise InfeasibleError when no layout can exist: model states or the embedding stage do not fit."""
    model = cache.model
    need, have = model_state_bytes(cache), usable_bytes(cache)
    if need > have:
        raise InfeasibleError(
            f"{model.name} needs at least {byte_size(need)} for weights, gradients and optimizer state; "
            f"the cluster has {byte_size(have)} usable ({cache.graph.size} devices)"
        )
    g = cache.graph
    best_need, best_cap = float("inf"), 0.0
    for n in range(len(g.cluster.nodes)):
        devs = tuple(i for i in range(g.size) if int(g.node[i]) == n)
        for degree in tp_degrees(model, len(devs)):
            group = devs[:degree]
            cap = cache.capacity(group)
            if cache.max_layers(degree, True, False, 1, cap) >= 1 or cache.max_layers(degree, True, True, 1, cap) >= 1:
                return
            reserve = cache.params.memory_reserve_bytes
            need_one = cache.stage_bytes(degree, 1, True, False, 1) - reserve
            if need_one < best_need:
                best_need, best_cap = need_one, cap - reserve
    raise InfeasibleError(
        f"no device group can hold the embedding and one layer of {model.name}: the smallest first stage needs "
        f"{byte_size(best_need)} per device, the best group has {byte_size(best_cap)} per device"
    )

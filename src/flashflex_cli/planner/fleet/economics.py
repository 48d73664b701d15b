"""What a plan's prediction means for the whole cluster: MFU over every device, and dollars.

`annotated` adds optional fields to `Plan.predicted` (old plans without them load as before):
- `peak_flops_cluster`: dense peak FLOP/s of every device of the cluster for the plan's dtype (FLOP/s),
  so MFU can be given over the same basis for every compared layout (`mfu` stays over the devices used);
- `devices_cluster`: how many devices the cluster has;
- `dollars` (with a prices file): currency, the prices file's sha256, cost per hour of the devices used
  and of the whole cluster, and the cost per million tokens on both bases.
"""

from __future__ import annotations

import math

from ...hardware.cluster import Cluster
from ...plan.predicted import PredictedDollars
from ...plan.schema import Plan
from .pricing import DevicePrices, per_million_tokens


def _r(value: float) -> float | None:
    """6 significant digits, as the cost model writes plans (byte-stable files); None when not finite."""
    return float(f"{value:.6g}") if math.isfinite(value) else None


def cluster_peak_flops(cluster: Cluster, dtype: str) -> float:
    """Dense peak FLOP/s of every device of `cluster` for `dtype` (emulation slowdown applied)."""
    return float(sum(device.flops(dtype) for node in cluster.nodes for device in node.devices))


def dollars(plan: Plan, prices: DevicePrices) -> PredictedDollars:
    """The plan's cost per hour (devices used; whole cluster) and per million tokens on both bases."""
    tokens_per_s = float(plan.predicted.tokens_per_s) if plan.predicted else 0.0
    used = prices.hourly(rank.device for rank in plan.ranks())
    whole = prices.cluster_hourly()
    return PredictedDollars.model_validate({
        "currency": prices.currency,
        "prices_sha256": prices.sha256,
        "per_hour_used": _r(used),
        "per_hour_cluster": _r(whole),
        "per_million_tokens_used": _r(per_million_tokens(used, tokens_per_s)),
        "per_million_tokens_cluster": _r(per_million_tokens(whole, tokens_per_s)),
    })


def annotated(plan: Plan, cluster: Cluster, prices: DevicePrices | None = None) -> Plan:
    """`plan` with the cluster-wide MFU basis (and `dollars` with `prices`) added to its prediction; a plan
    without a prediction is returned as it is."""
    if not plan.predicted:
        return plan
    predicted = plan.predicted.model_copy(update={
        "peak_flops_cluster": _r(cluster_peak_flops(cluster, plan.inputs.train.dtype)),
        "devices_cluster": len(cluster.device_ids),
        "dollars": None if prices is None else dollars(plan, prices)})
    return plan.model_copy(update={"predicted": predicted})

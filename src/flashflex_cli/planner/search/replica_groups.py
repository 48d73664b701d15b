"""Low-communication training in the planner (`flashflex plan --sync auto|full|local`): replica groups cut along
the fleet's slow links, H and per-group inner steps, and the choice against synchronous training.

Sites: nodes joined by a link at least `SITE_FRACTION` of the fleet's fastest inter-node link are one site
(union-find over the node pairs); the links between sites are the slow ones. Where every inter-node link is alike
(one site) but slow in absolute terms (under `FAST_LINK` bytes/s), each node may be its own group.

A local-sync plan: one replica group per site, each planned by the ordinary search on its own nodes with a share
of the global batch proportional to the site's peak FLOP/s; the slowest group runs H inner steps per round, every
other group as many as fit in the same time (`inner_steps_for`), so rounds end together and faster groups train
on more tokens (their pseudo-gradients weigh more). H: the smallest value within the user's range whose outer
all-reduce is at most `OUTER_SHARE` of the round (DiLoCo's quality falls slowly as H grows: arXiv 2311.08105,
section 4, figure 3), capped at the range's top. `auto` keeps the synchronous plan unless local sync is at least
`AUTO_GAIN` times faster by the cost model, and on a fleet of one fast site it does not try.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from ...cost.estimate import estimate
from ...cost.outer_sync import cross_bytes_per_token, round_estimate, round_predicted
from ...cost.params import CostParams
from ...errors import InfeasibleError, InputError
from ...hardware.cluster import Cluster
from ...plan.predicted import Predicted
from ...plan.schema import OuterSync, Plan, ReplicaGroup, TrainConfig, UnusedDevice
from ..fleet.reduced import reduced_cluster

SITE_FRACTION = 0.25  # a link under a quarter of the fastest inter-node link joins two sites
FAST_LINK = 12.5e9  # bytes/s (100 Gbit/s): inter-node links at least this fast are never cut
OUTER_SHARE = 0.05  # the outer all-reduce's largest share of a round when H is free to grow
AUTO_GAIN = 1.2  # local sync must be predicted this much faster for `auto` to choose it (its quality risk)
INNER_STEPS_RANGE = (16, 500)  # default range of H
SYNC_CHOICES = ("auto", "full", "local")
QUALITY_RECORD = "low_comm_quality.json"  # written by benchmarks/bench_low_comm.py


def parse_inner_steps(text: str) -> tuple[int, int]:
    """"MIN:MAX" or "N" -> the range of H (inner steps per round); InputError (exit 2) on bad input."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high <= 100_000:
        raise InputError(f"--inner-steps must be N or MIN:MAX with 1 <= MIN <= MAX <= 100000, got {text!r}")
    return low, high


def fleet_sites(cluster: Cluster) -> list[list[str]]:
    """Node names of each site (module docstring), in cluster order; one site when every link is fast."""
    names = [node.name for node in cluster.nodes]
    if len(names) < 2:
        return [names]
    links = {(a, b): cluster.node_link(a, b).bandwidth for i, a in enumerate(names) for b in names[i + 1:]}
    floor = SITE_FRACTION * max(links.values())
    parent = {name: name for name in names}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for (a, b), bandwidth in links.items():
        if bandwidth >= floor or bandwidth >= FAST_LINK:
            parent[root(b)] = root(a)
    sites: dict[str, list[str]] = {}
    for name in names:
        sites.setdefault(root(name), []).append(name)
    found = list(sites.values())
    if len(found) == 1 and max(links.values()) < FAST_LINK:
        return [[name] for name in names]  # all alike and all slow: every node may train on its own
    return found


def batch_shares(total: int, weights: Sequence[float]) -> list[int]:
    """`total` sequences split in proportion to `weights` (largest remainders; deterministic)."""
    exact = [total * w / sum(weights) for w in weights]
    shares = [int(math.floor(x)) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[:total - sum(shares)]:
        shares[i] += 1
    return shares


def inner_steps_for(step_s: Sequence[float], slowest_steps: int) -> list[int]:
    """Inner steps per round of each group: the slowest group `slowest_steps`, the others as many as fit in its
    time (at least 1)."""
    longest = max(step_s) * slowest_steps
    return [max(1, int(longest / t + 1e-9)) if t > 0 else slowest_steps for t in step_s]


def quality_evidence() -> dict[str, Any] | None:
    """The committed record of benchmarks/bench_low_comm.py (eval loss of local sync vs synchronous at equal
    tokens, bytes exchanged), or None when absent."""
    try:
        text = resources.files(__package__).joinpath(QUALITY_RECORD).read_text()
    except (FileNotFoundError, OSError):
        return None
    return json.loads(text)


def evidence_text(record: dict[str, Any] | None, steps: int) -> str:
    """One clause on the measured quality nearest to H = `steps` (the record's largest H not above it, else its
    smallest)."""
    if not record or not record.get("local"):
        return "no quality measurement recorded (run benchmarks/bench_low_comm.py)"
    runs = sorted(record["local"], key=lambda r: (r["inner_steps"], r.get("eval_loss_change_pct", 0.0)))
    below = [r for r in runs if r["inner_steps"] <= steps]
    run = below[-1] if below else runs[0]
    outer = (f", outer lr {run['outer_lr']:g} momentum {run['outer_momentum']:g}" if "outer_lr" in run else "")
    return (f"measured by benchmarks/bench_low_comm.py ({record.get('model', '?')}, {record.get('corpus', '?')}, "
            f"{record.get('tokens', 0):,} tokens): H={run['inner_steps']}{outer} reached eval loss "
            f"{run['eval_loss_change_pct']:+.1f}% vs synchronous at equal tokens"
            + ("" if run["inner_steps"] >= steps else f"; H={steps} lies beyond what was measured"))


def local_sync_plan(cluster: Cluster, train: TrainConfig, plan_site: Callable[[Cluster, TrainConfig], Plan],
                    params: CostParams, inner_steps: tuple[int, int] = INNER_STEPS_RANGE,
                    sites: list[list[str]] | None = None) -> Plan | None:
    """A plan of replica groups, one per site, or None when the fleet is one site. `plan_site(sub_cluster,
    train)` plans one site synchronously (the ordinary search)."""
    sites = sites if sites is not None else fleet_sites(cluster)
    if len(sites) < 2:
        return None
    from ...cost.view import view

    cv = view(cluster)
    power = [sum(cv.peak(d, train.dtype) for d in cluster.device_ids if cluster.node_of(d) in site) for site in sites]
    shares = batch_shares(train.global_batch, power)
    plans: list[Plan] = []
    unused: list[UnusedDevice] = []
    for site, share in zip(sites, shares, strict=True):
        devices = [d for d in cluster.device_ids if cluster.node_of(d) in site]
        if share == 0:
            unused += [UnusedDevice(device=d, reason="local sync: its site's share of the batch rounds to 0")
                       for d in devices]
            continue
        try:
            found = plan_site(reduced_cluster(cluster, site), train.model_copy(update={"global_batch": share}))
        except InfeasibleError as exc:
            unused += [UnusedDevice(device=d, reason=f"local sync: its site cannot train alone ({exc})"[:200])
                       for d in devices]
            continue
        plans.append(found)
        unused += list(found.unused_devices)
    if len(plans) < 2:
        return None
    step_s = [estimate(p, cluster, params).iteration_time_s for p in plans]
    pipelines = [pipe for p in plans for pipe in p.pipelines]
    train_all = train.model_copy(update={"global_batch": sum(p.inputs.train.global_batch for p in plans)})
    groups_at = _group_indices([len(p.pipelines) for p in plans])
    inputs = plans[0].inputs.model_copy(update={"train": train_all, "cluster_sha256": cluster.sha256(),
                                                "cluster_name": cluster.name})

    def build(slowest: int) -> Plan:
        steps = inner_steps_for(step_s, slowest)
        outer = OuterSync(groups=[ReplicaGroup(pipelines=g, inner_steps=h) for g, h in zip(groups_at, steps,
                                                                                          strict=True)])
        return Plan(inputs=inputs, pipelines=pipelines, unused_devices=unused, outer_sync=outer)

    low, high = inner_steps
    chosen = high
    for h in _candidates(low, high):
        rounded = round_estimate(build(h), cluster, params)
        if rounded.outer_exposed_s <= OUTER_SHARE * rounded.round_s:
            chosen = h
            break
    plan = build(chosen)
    return plan.model_copy(update={"predicted": Predicted.model_validate(round_predicted(plan, cluster, params))})


def _candidates(low: int, high: int) -> list[int]:
    """H values tried from `low` up: powers of two times `low`, then `high`."""
    out, h = [], low
    while h < high:
        out.append(h)
        h *= 2
    return out + [high]


def _group_indices(counts: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def site_of_ranks(plan: Plan, cluster: Cluster, sites: list[list[str]]) -> list[int]:
    """The site index of every rank of `plan`."""
    node_site = {node: i for i, site in enumerate(sites) for node in site}
    devices = [d for pipe in plan.pipelines for stage in pipe.stages for d in stage.devices]
    return [node_site[cluster.node_of(d)] for d in devices]


def choose_sync(sync: str, synchronous: Plan, cluster: Cluster, plan_site: Callable[[Cluster, TrainConfig], Plan],
                params: CostParams, inner_steps: tuple[int, int] = INNER_STEPS_RANGE) -> Plan:
    """The plan `--sync` asks for: `full` the synchronous one; `local` replica groups (InputError when the fleet
    is one fast site); `auto` replica groups only where the cost model predicts them `AUTO_GAIN` times faster.
    A local-sync plan's `outer_sync.reason` says why, the traffic saved and the quality evidence."""
    if sync not in SYNC_CHOICES:
        raise InputError(f"--sync must be one of {', '.join(SYNC_CHOICES)}, got {sync!r}")
    if sync == "full":
        return synchronous
    sites = fleet_sites(cluster)
    local = local_sync_plan(cluster, synchronous.inputs.train, plan_site, params, inner_steps, sites)
    if local is None:
        if sync == "local":
            raise InputError(f"--sync local: cluster {cluster.name!r} has no slow link to cut along (one site of "
                             "fast links, or fewer than two sites that can train alone)")
        return synchronous
    fast = float((synchronous.predicted or {}).get("tokens_per_s") or 0.0)
    slow = float((local.predicted or {}).get("tokens_per_s") or 0.0)
    if sync == "auto" and slow < AUTO_GAIN * fast:
        return synchronous
    assert local.outer_sync is not None
    sync_bytes = cross_bytes_per_token(synchronous, site_of_ranks(synchronous, cluster, sites))
    local_bytes = cross_bytes_per_token(local, site_of_ranks(local, cluster, sites))
    slowest = max(h.inner_steps for h in local.outer_sync.groups)
    saved = (f"{sync_bytes / local_bytes:,.0f}x fewer bytes across the slow links per token "
             f"({local_bytes:,.1f} vs {sync_bytes:,.1f} B/token synchronous)" if local_bytes > 0 and sync_bytes > 0
             else f"{local_bytes:,.1f} B/token across the slow links ({sync_bytes:,.1f} synchronous)")
    reason = (f"{len(local.outer_sync.groups)} sites joined by slow links; predicted {slow / fast:.2f}x the "
              f"synchronous plan's tokens/s; {saved}; quality: {evidence_text(quality_evidence(), slowest)}"
              if fast > 0 else f"{saved}; quality: {evidence_text(quality_evidence(), slowest)}")
    outer = local.outer_sync.model_copy(update={"reason": reason})
    predicted = dict(local.predicted or {})
    for key in ("peak_flops_cluster", "devices_cluster"):  # whole-cluster figures: the same cluster
        if key in (synchronous.predicted or {}):
            predicted[key] = (synchronous.predicted or {})[key]
    predicted["outer_sync"] = {**dict(predicted.get("outer_sync") or {}), "synchronous_tokens_per_s": fast,
                               "cross_bytes_per_token": local_bytes, "synchronous_cross_bytes_per_token": sync_bytes}
    inputs = local.inputs.model_copy(update={"cluster_path": synchronous.inputs.cluster_path,
                                             "dtype_reason": synchronous.inputs.dtype_reason,
                                             "strategy": synchronous.inputs.strategy})
    return local.model_copy(update={"outer_sync": outer, "predicted": Predicted.model_validate(predicted),
                                    "inputs": inputs})

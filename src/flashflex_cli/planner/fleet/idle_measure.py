"""Why a plan leaves devices idle, measured: one line per idle node group (`idle_groups.group_idle`).

For each group the cost model (`cost.estimate`) is
asked about two modified plans:

- the group as a pipeline of its own: its stage structure from level 2 (`stage_search.best_pipeline`), the
  global batch re-split over all pipelines (`batch_split.split_batch` on each pipeline's pace and fill);
- the group as extra stages of an existing pipeline (at its end or its front; the two pipelines with the
  fastest link to the group are tried), layers re-split exactly (`pipeline_score.evaluate_pipeline`), batch
  re-split likewise.

The best of these is reported with its tokens/s change against the plan and the dominating reason, from
the two estimates: the data-parallel reduction's exposed time (DP), the critical pipeline's transfers
over the new link (p2p) or its idle share (bubble), or memory / batch when the modified plan cannot run.
A group whose devices lack the training dtype (no tensor cores for it) says so: the cost model gives them
no more than their fp32 rate, which is often why they do not pay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...cost.estimate import Estimate, StageEstimate, estimate
from ...cost.params import CostParams
from ...cost.schedule import fill_s, steady_period_s
from ...errors import FlashflexError
from ...hardware.cluster import Cluster
from ...hardware.links import Link
from ...plan.schema import PipelinePlan, Plan, StagePlan
from ...units import byte_size
from ..scoring.cost_cache import CostCache
from ..scoring.feasibility import model_state_bytes
from ..scoring.pipeline_score import PipeEval, evaluate_pipeline
from ..space.batch_split import split_batch
from ..space.graph import DeviceGraph
from ..space.tp_groups import chunk, tp_degrees
from ..structure.stage_search import best_pipeline
from .idle_groups import IdleGroup, dtype_note, group_idle, group_label, link_text
from .pricing import DevicePrices

EXTEND_PIPELINES = 2  # existing pipelines tried for "extra stages" (fastest links to the group first)


@dataclass(frozen=True)
class _Option:
    what: str
    tokens_per_s: float  # 0 when the modified plan cannot run
    why: str


def _pace_fill(stages: Sequence[StageEstimate]) -> tuple[float, float]:
    """A pipeline's 1F1B pace (s per micro-batch) and fill (s) from its stages' estimates."""
    times = [st.fwd_s + st.bwd_s for st in stages]
    links = [st.p2p_s for st in stages[:-1]]
    return steady_period_s(times, links), fill_s(times, links)


def split_sequences(global_batch: int, mbs: Sequence[int], pace_s: Sequence[float], fill_s: Sequence[float],
                    min_counts: Sequence[int]) -> list[int] | None:
    """Micro-batches per pipeline (pipeline p's micro-batches hold mbs[p] sequences) summing to
    `global_batch` sequences, the slowest pipeline (fill + (m - 1) x pace, seconds) as short as the greedy
    finds; None when the batch cannot be split so (too small, or sizes that cannot add up)."""
    if len(set(mbs)) == 1:
        if global_batch % mbs[0]:
            return None
        return split_batch(global_batch // mbs[0], pace_s, [f - p for f, p in zip(fill_s, pace_s, strict=True)],
                           min_counts)
    counts = list(min_counts)
    left = global_batch - sum(c * m for c, m in zip(counts, mbs, strict=True))
    while left > 0:
        fits = [p for p in range(len(counts)) if mbs[p] <= left]
        if not fits:
            return None
        p = min(fits, key=lambda q: (fill_s[q] + counts[q] * pace_s[q], q))
        counts[p] += 1
        left -= mbs[p]
    return counts if left == 0 else None


class _Measure:
    """Modified plans of one plan on one cluster, estimated."""

    def __init__(self, plan: Plan, cluster: Cluster, params: CostParams) -> None:
        self.plan, self.cluster, self.params = plan, cluster, params
        train = plan.inputs.train
        # an idle group's pipeline or stages run the plan's smallest micro-batch size (sequences)
        self.micro_batch = min(pipe.micro_batch_size for pipe in plan.pipelines)
        self.cache = CostCache(DeviceGraph(cluster, train.dtype), plan.inputs.model, train, params, self.micro_batch)
        self.base = estimate(plan, cluster, params)
        by_pipe: dict[int, list[StageEstimate]] = {}
        for st in self.base.stages:
            by_pipe.setdefault(st.pipeline, []).append(st)
        self.pace_fill = [_pace_fill(by_pipe[p]) for p in range(len(plan.pipelines))]

    def _stages_of(self, devs: Sequence[tuple[int, ...]], counts: Sequence[int]) -> list[StagePlan]:
        ids = self.cache.graph.ids
        out, start = [], 0
        for group, n in zip(devs, counts, strict=True):
            out.append(StagePlan(devices=[ids[i] for i in group], tp=len(group), layers=(start, start + n)))
            start += n
        return out

    def _build(self, pipelines: list[list[StagePlan]], mbs: list[int], pace: list[float], fill: list[float],
               idle: set[str]) -> Plan | None:
        counts = split_sequences(self.plan.inputs.train.global_batch, mbs, pace, fill,
                                 [len(stages) for stages in pipelines])
        if counts is None:
            return None
        pipes = [PipelinePlan(micro_batch_size=b, num_micro_batches=m, stages=s)
                 for s, b, m in zip(pipelines, mbs, counts, strict=True)]
        unused = [u for u in self.plan.unused_devices if u.device not in idle]
        return Plan(inputs=self.plan.inputs, pipelines=pipes, unused_devices=unused)

    def _existing(self) -> tuple[list[list[StagePlan]], list[int]]:
        return [list(p.stages) for p in self.plan.pipelines], [p.micro_batch_size for p in self.plan.pipelines]

    def group_pipeline(self, idx: list[int]) -> PipeEval | None:
        """Level 2's best pipeline of the group's devices at their share of the batch; None if none fits."""
        cache, train = self.cache, self.plan.inputs.train
        g = cache.graph
        used = [g.index[r.device] for r in self.plan.ranks()]
        share = float(g.flops[idx].sum()) / float(g.flops[used + idx].sum())
        total_micro = max(1, train.global_batch // self.micro_batch)
        return best_pipeline(cache, idx, max(1, round(total_micro * share)), total_micro)

    def own_pipeline(self, idx: list[int], devices: set[str], pipe: PipeEval | None) -> _Option:
        """The group as one more pipeline (`pipe`: its structure, from `group_pipeline`)."""
        cache = self.cache
        what = "as a pipeline of its own"
        if pipe is None:
            reserve = cache.params.memory_reserve_bytes
            need, usable = model_state_bytes(cache), sum(cache.capacity((i,)) - reserve for i in idx)
            if need > usable:
                why = (f"memory: {self.plan.inputs.model.name}'s weights, gradients and optimizer state need "
                       f"{byte_size(need)}, its devices have {byte_size(usable)} usable")
            else:
                why = "memory: no split of the layers over its devices fits with the activations in flight"
            return _Option(what, 0.0, why)
        stages, mbs = self._existing()
        stages.append(self._stages_of(pipe.stages, pipe.counts))
        mbs.append(self.micro_batch)
        pace = [pf[0] for pf in self.pace_fill] + [pipe.pace_s]
        fill = [pf[1] for pf in self.pace_fill] + [pipe.fill_s]
        return self._judge(what, self._build(stages, mbs, pace, fill, devices), len(stages) - 1, idx, pipe.num_stages)

    def extra_stages(self, idx: list[int], devices: set[str], own: PipeEval | None) -> _Option | None:
        """The group as extra stages (at the end or the front) of the pipelines with the fastest links to it;
        its TP groups as in `own` (its own pipeline's structure), else of the largest supported degree."""
        cache, cluster = self.cache, self.cluster
        g = cache.graph
        node = cluster.node_of(g.ids[idx[0]])
        degrees = tp_degrees(self.plan.inputs.model, len(idx))
        chunks = list(own.stages) if own is not None else chunk(idx, degrees[-1], degrees)

        def nearest(p: int) -> tuple[float, int]:
            pipe_nodes = {cluster.node_of(d) for st in self.plan.pipelines[p].stages for d in st.devices}
            return (-max(self._node_bw(node, n) for n in pipe_nodes), p)

        best: _Option | None = None
        for p in sorted(range(len(self.plan.pipelines)), key=nearest)[:EXTEND_PIPELINES]:
            old = [tuple(g.index[d] for d in st.devices) for st in self.plan.pipelines[p].stages]
            for front in (False, True):
                order = tuple(chunks + old) if front else tuple(old + chunks)
                what = (f"as {len(chunks)} extra stage{'s' if len(chunks) > 1 else ''} at the "
                        f"{'front' if front else 'end'} of pipeline {p}")
                ev = evaluate_pipeline(cache, order)
                if not ev.ok:
                    option = _Option(what, 0.0, "memory: no split of the layers over the longer pipeline fits")
                else:
                    stages, mbs = self._existing()
                    stages[p] = self._stages_of(ev.stages, ev.counts)
                    mbs[p] = self.micro_batch
                    pace = [pf[0] for pf in self.pace_fill]
                    fill = [pf[1] for pf in self.pace_fill]
                    pace[p], fill[p] = ev.pace_s, ev.fill_s
                    option = self._judge(what, self._build(stages, mbs, pace, fill, devices), p, idx, len(order))
                if best is None or option.tokens_per_s > best.tokens_per_s:
                    best = option
        return best

    def _node_bw(self, a: str, b: str) -> float:
        if a == b:
            return float("inf")
        return self.cluster.node_link(a, b).bandwidth

    def _slowest_link(self, node: str, others: set[str]) -> Link | None:
        links = [self.cluster.node_link(node, n) for n in sorted(others) if n != node]
        return min(links, key=lambda link: link.bandwidth) if links else None

    def _judge(self, what: str, plan: Plan | None, pipe: int, idx: list[int], stages: int) -> _Option:
        """Estimate a modified plan (pipeline `pipe` is the new or extended one) and name the dominating
        reason for its change against the plan."""
        if plan is None:
            total = self.plan.inputs.train.global_batch
            return _Option(what, 0.0, f"batch: {total} sequences cannot give every pipeline a micro-batch per "
                                      f"stage ({stages} stages here)")
        try:
            new = estimate(plan, self.cluster, self.params)
        except FlashflexError as exc:  # e.g. a device type without a FLOP/s figure for the dtype
            return _Option(what, 0.0, str(exc))
        if not new.fits:
            return _Option(what, 0.0, f"memory: {new.problems[0]}")
        return _Option(what, new.tokens_per_s, self._why(new, plan, pipe, idx))

    def _why(self, new: Estimate, plan: Plan, pipe: int, idx: list[int]) -> str:
        base, cluster = self.base, self.cluster
        node = cluster.node_of(self.cache.graph.ids[idx[0]])
        if new.tokens_per_s > base.tokens_per_s:
            return "faster by the cost model: the search did not find this layout (try a larger --time-budget)"
        dp = new.dp_exposed_s - base.dp_exposed_s
        slowest = max(range(len(new.pipelines)), key=lambda p: (new.pipelines[p].time_s, -p))
        pipe_delta = new.pipelines[slowest].time_s - max(p.time_s for p in base.pipelines)
        optimizer = new.optimizer_s - base.optimizer_s
        if optimizer > max(dp, pipe_delta, 0.0):
            return (f"optimizer: its step takes {new.optimizer_s:.3g} s on its memory bandwidth "
                    f"(was {base.optimizer_s:.3g} s)")
        if dp >= pipe_delta and dp > 0:
            link = self._slowest_link(node, {cluster.node_of(r.device) for r in plan.ranks()})
            over = f" over {link_text(link)}" if link is not None else ""
            return f"its gradient reduction{over} exposes {new.dp_exposed_s:.3g} s (was {base.dp_exposed_s:.3g} s)"
        est = new.pipelines[slowest]
        stages = [st for st in new.stages if st.pipeline == slowest]
        group = {self.cache.graph.ids[i] for i in idx}
        crossing = [k for k in range(len(stages) - 1)
                    if bool(set(stages[k].devices) & group) != bool(set(stages[k + 1].devices) & group)]
        own_step = 2 * sum(stages[k].p2p_s for k in crossing) * est.num_micro_batches
        all_step = 2 * sum(st.p2p_s for st in stages[:-1]) * est.num_micro_batches
        idle_s = est.bubble_fraction * est.time_s
        where = "its pipeline" if slowest == pipe else f"pipeline {slowest}"
        if slowest != pipe and pipe < len(self.plan.pipelines) and (
                new.pipelines[pipe].num_micro_batches < self.plan.pipelines[pipe].num_micro_batches):
            where += f" (micro-batches moved to it from the slowed pipeline {pipe})"
        if crossing and own_step > 0.5 * idle_s:
            link = self._slowest_link(node, {cluster.node_of(d) for st in stages for d in st.devices})
            over = f" over {link_text(link)}" if link is not None else ""
            return f"p2p: activations to and from it{over} take {own_step:.3g} s per step in {where}"
        was = ""
        if slowest < len(base.pipelines) and slowest < len(self.plan.pipelines):
            was = f", was {base.pipelines[slowest].bubble_fraction * 100:.0f}% of {base.pipelines[slowest].time_s:.3g} s"
        if all_step > 0.5 * idle_s:
            hops = [cluster.link(stages[k].devices[0], stages[k + 1].devices[0]) for k in range(len(stages) - 1)]
            slow = min(hops, key=lambda link: link.bandwidth)
            return (f"p2p: {where} ({len(stages)} stages over links down to {link_text(slow)}) moves activations "
                    f"for {all_step:.3g} s per step and idles {est.bubble_fraction * 100:.0f}% of its {est.time_s:.3g} s"
                    f"{was}")
        return (f"bubble: {where} ({len(stages)} stages, {est.num_micro_batches} micro-batches) idles "
                f"{est.bubble_fraction * 100:.0f}% of its {est.time_s:.3g} s{was}")


def _pct(option: _Option, base: float) -> str:
    if option.tokens_per_s <= 0:
        return "cannot run"
    return f"{(option.tokens_per_s - base) / base * 100:+.1f}% tokens/s"


def measure_idle(plan: Plan, cluster: Cluster, params: CostParams | None = None,
                 prices: DevicePrices | None = None) -> list[IdleGroup]:
    """One measured line per idle node group of `plan` on `cluster` (module docstring); `prices` adds what
    the group costs per hour."""
    params = params or CostParams()
    groups = group_idle(plan, cluster)
    if not groups or not plan.pipelines:
        return []
    measure = _Measure(plan, cluster, params)
    base = measure.base.tokens_per_s
    index = measure.cache.graph.index
    out = []
    for devices, nodes in groups:
        probe = [d for d in devices if cluster.node_of(d) == nodes[0]]
        idx = [index[d] for d in probe]
        pipe = measure.group_pipeline(idx)
        own = measure.own_pipeline(idx, set(probe), pipe)
        extra = measure.extra_stages(idx, set(probe), pipe)
        parts = [f"{own.what}: {_pct(own, base)} ({own.why})"]
        if extra is not None:
            parts.append(f"{extra.what}: {_pct(extra, base)} ({extra.why})")
        text = f"using {group_label(cluster, devices, nodes)} " + "; ".join(parts) + dtype_note(cluster, probe,
                                                                                          plan.inputs.train.dtype)
        if prices is not None:
            each = " each" if len(nodes) > 1 else ""
            text += f"; it costs {prices.currency} {prices.hourly(probe):,.2f}/h{each}"
        out.append(IdleGroup(devices, nodes, group_label(cluster, devices, nodes), text))
    return out

"""Cost of the DP gradient reduction (cost/dp.py): per-layer overlap with the last backward, hierarchical against
flat reduction across a slow inter-node link, and the switches that mirror the runtime's options."""

from __future__ import annotations

import random

import pytest

from flashflex_cli.cost.comm import ring_allreduce_seconds
from flashflex_cli.cost.dp import (
    KEY_EMBED,
    KEY_HEAD,
    KEY_NORM,
    DPBucket,
    NicQueue,
    StageBackward,
    bucket_cost,
    dp_buckets,
    dp_timeline,
    layer_ready_s,
    layers_ready_s,
    ring_bucket_time,
)
from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.params import CostParams
from flashflex_cli.errors import InputError
from flashflex_cli.model import flops as F
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import TrainConfig

from .cost_fixtures import cluster, plan, stage

MODEL = PRESETS["llama-small"]


def _layers_timeline(layer_s: float, overlap: bool = True) -> float:
    """Two one-stage holders of 4 layers, each layer's bucket 1 s, backward from 0 with `layer_s` per layer:
    the exposed reduction (s)."""
    buckets = [DPBucket(layer, ((0, 0), (1, 0)), 1.0, 0.0, 1.0, frozenset()) for layer in (3, 2, 1, 0)]
    backward = {k: StageBackward(0.0, 4 * layer_s, 0.0, layer_s, (0, 4), True) for k in ((0, 0), (1, 0))}
    return dp_timeline(buckets, backward, overlap).exposed_s[(0, 0)]


def test_overlap_hides_more_when_lower_layers_have_more_backward() -> None:
    # layer 3 is ready at layer_s, layer 2 at 2 layer_s, ...; buckets run one after another.
    # layer_s 0.5: buckets back to back from 0.5, the last ends at 4.5, the backward at 2: 2.5 exposed.
    assert _layers_timeline(0.5) == pytest.approx(2.5)
    # layer_s 2: each bucket finishes before the next layer is done; only the bottom layer's (1 s) shows.
    assert _layers_timeline(2.0) == pytest.approx(1.0)
    # without overlap the whole reduction (4 s) follows the backward, however long the backward is.
    assert _layers_timeline(0.5, overlap=False) == pytest.approx(4.0)
    assert _layers_timeline(2.0, overlap=False) == pytest.approx(4.0)


def test_bucket_order_is_the_runtimes() -> None:
    """Head, final norm, layers from the top, embedding last (runtime/parallel/grad_buckets.py)."""
    c = cluster(("A100-80G-SXM", 2, "eth", "nvlink"), ("A100-80G-SXM", 2, "eth", "nvlink"))
    pipes = [(2, [stage([f"node{n}/0"], 0, 2), stage([f"node{n}/1"], 2, 4)]) for n in range(2)]
    tiny = PRESETS["llama-tiny"]
    p = plan(c, tiny, TrainConfig(global_batch=4, seq_len=64), pipes)
    keys = [b.key for b in dp_buckets(p, c, CostParams())]
    assert keys == [KEY_HEAD, KEY_NORM, 3, 2, 1, 0, KEY_EMBED]
    blocking = dp_buckets(p, c, CostParams(dp_overlap=False))
    assert [b.holders for b in blocking] == [((0, 0), (1, 0)), ((0, 1), (1, 1))]  # one bucket per holder set
    assert sum(b.params for b in blocking) == pytest.approx(F.total_params(tiny))


def _six_pipelines(nodes: int, hierarchical: bool):
    """Six one-device pipelines of all layers on `nodes` nodes (6 / nodes devices each), 1 GbE between nodes."""
    per = 6 // nodes
    c = cluster(*[("A100-80G-SXM", per, "eth", "nvlink")] * nodes)
    pipes = [(2, [stage([f"node{n}/{d}"], 0, MODEL.num_layers)]) for n in range(nodes) for d in range(per)]
    p = plan(c, MODEL, TrainConfig(global_batch=12, seq_len=512), pipes)
    params = CostParams(dp_hierarchical=hierarchical)
    return p, c, params, estimate(p, c, params)


def test_hierarchical_charges_inside_then_across_and_beats_flat_over_ethernet() -> None:
    p, c, params, hier = _six_pipelines(3, True)
    _, _, flat_params, flat = _six_pipelines(3, False)
    holders = [(i, 0) for i in range(6)]
    n = F.layer_params(MODEL)
    inside, across, nodes = bucket_cost(p, c, holders, n, params)
    # inside each node: a 2-ring of the fp32 layer gradient over NVLink (300 GB/s, 2 us); across: a 3-ring of
    # the leaders over Ethernet (1.25 GB/s, 50 us)
    assert inside == pytest.approx(ring_allreduce_seconds(2, 4 * n, 300e9, 2e-6))
    assert across == pytest.approx(ring_allreduce_seconds(3, 4 * n, 1.25e9, 5e-5))
    assert nodes == {"node0", "node1", "node2"}
    flat_inside, flat_across, _ = bucket_cost(p, c, holders, n, flat_params)
    assert (flat_inside, flat_across) == pytest.approx((0.0, ring_allreduce_seconds(6, 4 * n, 1.25e9, 5e-5)))
    # 2 (m-1)/m = 4/3 of the bytes across instead of 2 (N-1)/N = 5/3: hierarchical is cheaper
    assert hier.stages[0].dp_s < flat.stages[0].dp_s
    assert hier.dp_exposed_s < flat.dp_exposed_s
    assert hier.iteration_time_s < flat.iteration_time_s


def test_hierarchical_equals_flat_on_one_node() -> None:
    _, _, _, hier = _six_pipelines(1, True)
    _, _, _, flat = _six_pipelines(1, False)
    assert hier.iteration_time_s == flat.iteration_time_s
    assert [s.dp_s for s in hier.stages] == [s.dp_s for s in flat.stages]


def test_switches_load_from_cost_parameter_files() -> None:
    params = CostParams.from_overrides({"dp_overlap": False, "dp_hierarchical": False, "dp_overlap_fraction": 0.5})
    assert (params.dp_overlap, params.dp_hierarchical, params.dp_overlap_fraction) == (False, False, 0.5)
    assert CostParams().dp_overlap and CostParams().dp_hierarchical  # the runtime's defaults
    with pytest.raises(InputError, match="true or false"):
        CostParams.from_overrides({"dp_overlap": 1})


def test_show_reports_the_exposed_reduction() -> None:
    """`flashflex show` (plan/render.py) prints the exposed DP time first, then the busiest stage's whole one."""
    import io

    from rich.console import Console

    from flashflex_cli.plan.render import dp_line, render_plan

    p, c, params, est = _six_pipelines(3, True)
    shown = p.model_copy(update={"predicted": est.to_predicted()})
    line = dp_line(shown.predicted)
    assert line is not None
    assert line.startswith(f"DP gradient reduction: {est.dp_exposed_s * 1e3:,.1f} ms exposed")
    assert f"{max(s.dp_s for s in est.stages) * 1e3:,.1f} ms" in line
    out = io.StringIO()
    render_plan(Console(file=out, width=200), shown)
    assert line in out.getvalue()
    # nothing to reduce (one pipeline, untied): no line
    one = plan(c, MODEL, TrainConfig(global_batch=2, seq_len=512), [(2, [stage(["node0/0"], 0, MODEL.num_layers)])])
    assert dp_line(estimate(one, c).to_predicted()) is None


@pytest.mark.parametrize("hierarchical", [True, False])
def test_a_buckets_time_does_not_depend_on_how_its_nodes_are_keyed(hierarchical: bool) -> None:
    """`ring_bucket_time` keyed by node names (as `bucket_cost`) and by node indices (as the planner's fast
    score): the same seconds, the same nodes."""
    c = cluster(*[("A100-80G-SXM", 2, "eth", "nvlink")] * 3)
    params = CostParams(dp_hierarchical=hierarchical)
    firsts = [f"node{n}/{d}" for n in range(3) for d in range(2)]
    named = ring_bucket_time(c, firsts, [d.split("/")[0] for d in firsts], 2, 1e9, params)
    indexed = ring_bucket_time(c, firsts, [int(d[4]) for d in firsts], 2, 1e9, params)
    assert named[:2] == indexed[:2] and named.across_s > 0 and (named.inside_s > 0) == hierarchical
    assert named.nodes == {"node0", "node1", "node2"} and indexed.nodes == {0, 1, 2}


def test_the_nic_queue_frees_a_segments_nics_as_a_plain_queue_does() -> None:
    """`NicQueue` writes a bucket's NICs back only when a bucket on other nodes comes: the same ends as a queue
    that writes every node's NIC after every bucket, on random buckets (segments share their nodes object)."""
    rng = random.Random(6)
    for _ in range(200):
        segments = [frozenset(rng.sample(range(5), rng.randint(0, 3))) for _ in range(4)]
        queue, free, begin = NicQueue(), {}, 0.0
        for _ in range(30):
            nodes = rng.choice(segments)
            inside, across = rng.choice([0.0, rng.uniform(0, 1)]), rng.uniform(0, 1) if nodes else 0.0
            begin = max(0.0, begin + rng.uniform(-1.0, 1.0))
            start = max([begin + inside / 2] + [free.get(n, 0.0) for n in nodes])
            for n in nodes:
                free[n] = start + across
            assert queue.run(begin, inside, across, nodes) == start + across + inside / 2


def test_layers_ready_a_stage_at_a_time_are_the_layer_by_layer_sums() -> None:
    """`layers_ready_s` gives, to the last bit, what `layer_ready_s` (`StageBackward.ready_s`'s sums) gives for
    each layer of each stage, bottom layer first."""
    rng = random.Random(9)
    for _ in range(200):
        stages = [(rng.uniform(-5.0, 0.0), rng.choice([0.0, rng.uniform(0.0, 0.5)]), rng.uniform(0.0, 0.3),
                   rng.randint(1, 12)) for _ in range(rng.randint(1, 6))]
        want = [layer_ready_s(start, head, layer, above) for start, head, layer, count in stages
                for above in range(count, 0, -1)]
        assert layers_ready_s(*zip(*stages, strict=True)) == want

"""Planning fleets with devices that lack bf16: the plans' claims against an independent compute-only count,
the reasons for idle devices, and `flashflex plan --dtype auto`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.cost.params import CostParams
from flashflex_cli.cost.reference_efficiency import REFERENCE_EFFICIENCY
from flashflex_cli.errors import InfeasibleError
from flashflex_cli.hardware.catalog import device_type
from flashflex_cli.hardware.cluster import Cluster, save_cluster
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.model import flops as F
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import Plan, TrainConfig
from flashflex_cli.planner import search
from flashflex_cli.planner.fleet.objective import reduced_cluster
from flashflex_cli.planner.fleet.precision import DtypeTrial, choose_dtype
from flashflex_cli.planner.search import driver

from .cost_fixtures import cluster, plan, stage

# Written out here, not read from the catalog: parts whose tensor cores take fp16 but not bf16 (Volta, Turing).
NO_BF16 = {"V100-16G", "T4"}


def real_rate(type_name: str, dtype: str) -> float:
    """FLOP/s one device really achieves on a layer's matmuls in `dtype`: the datasheet peak of the dtype
    it computes in (fp32 where it lacks bf16) times the measured efficiency of that dtype class."""
    kind = device_type(type_name)
    computed = "fp32" if dtype == "bf16" and kind.name in NO_BF16 else dtype
    efficiency = REFERENCE_EFFICIENCY[f"{kind.name}:{'fp32' if computed == 'fp32' else 'fp16'}"][0]
    return kind.peak_flops[computed] * efficiency


def counted_tokens_per_s(plan: Plan, cluster: Cluster) -> float:
    """Tokens/s by a compute-only count: each stage's model FLOPs per micro-batch over its slowest device's
    real rate, each pipeline an ideal 1F1B (fill + (m - 1) x the slowest stage), no communication at all."""
    model, train = plan.inputs.model, plan.inputs.train
    slowest = 0.0
    for pipe in plan.pipelines:
        b, times = pipe.micro_batch_size, []
        for s, st in enumerate(pipe.stages):
            flops = st.num_layers * (F.layer_fwd_flops(model, b, train.seq_len)
                                     + F.layer_bwd_flops(model, b, train.seq_len, train.recompute))
            if s == len(pipe.stages) - 1:
                flops += F.head_fwd_flops(model, b, train.seq_len) + F.head_bwd_flops(model, b, train.seq_len)
            rate = min(real_rate(cluster.device(d).type, train.dtype) for d in st.devices)
            times.append(flops / st.tp / rate)
        slowest = max(slowest, sum(times) + (pipe.num_micro_batches - 1) * max(times))
    return train.global_batch * train.seq_len / slowest


HELD_OUT_LIKE = [
    # V100 nodes beside A100s; T4s beside L4s (newer nodes first: the symmetric layout runs on those)
    ("2x8xA100-80G-SXM:nic=ib,4x8xV100-16G:nic=ib", 2, "llama2-7b", 256, 4096),
    ("2x4xL4,4x4xT4", 2, "llama-1b", 128, 2048),
]


@pytest.mark.parametrize(("spec", "newer", "model", "batch", "seq"), HELD_OUT_LIKE, ids=["v100", "t4"])
def test_bf16_plans_claim_what_a_compute_only_count_gives(spec: str, newer: int, model: str, batch: int,
                                                         seq: int) -> None:
    """Before devices lacking bf16 were costed at their fp32 rate, these plans claimed 1.58x and 1.94x of the
    symmetric layout on the newer nodes while the count put them at 0.30x and 0.36x (claims 4.9x the count):
    now no plan claims more than the count of what its stages really compute."""
    cluster = build_cluster(spec)
    train = TrainConfig(global_batch=batch, seq_len=seq, dtype="bf16")
    params = CostParams()
    planned = search.plan_layout(cluster, PRESETS[model], train, params=params, max_micro_batch=8)
    symmetric = search.plan_layout(reduced_cluster(cluster, [n.name for n in cluster.nodes[:newer]]),
                                   PRESETS[model], train, strategy="uniform", params=params)
    claimed = planned.predicted["tokens_per_s"], symmetric.predicted["tokens_per_s"]
    counted = counted_tokens_per_s(planned, cluster), counted_tokens_per_s(symmetric, cluster)
    # the count leaves out communication, bubbles' tails, the operations besides the matrix products (their bytes
    # at the memory bandwidth: a large share on the L4's and T4's 300 GB/s, where the 128k-vocabulary loss runs)
    # and fixed per-micro-batch costs: a claim may sit below it by that much, never above it
    assert claimed[0] <= 1.02 * counted[0] and claimed[1] <= 1.02 * counted[1]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, spec in (("mixed", "1x8xA100-80G-SXM:nic=ib,2x8xV100-16G:nic=ib"), ("a100", "2x8xA100-80G-SXM:nic=ib"),
                       ("t4", "2x4xL4,4x4xT4")):
        out[name] = tmp_path / f"{name}.json"
        save_cluster(out[name], build_cluster(spec, name=name))
    return out


ARGS = ["--model", "llama2-7b", "--global-batch", "64", "--seq-len", "2048", "--no-baseline"]


def _plan(cluster: Path, out: Path, *extra: str) -> Plan:
    assert main(["plan", str(cluster), *ARGS, "--out", str(out), *extra]) == 0
    return Plan.model_validate_json(out.read_text())


def test_auto_picks_fp16_on_a100_and_v100_nodes_and_uses_the_v100s(files: dict[str, Path], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = driver.plan_layout

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(args[2].dtype)
        return original(*args, **kwargs)

    monkeypatch.setattr(driver, "plan_layout", counting)  # (the searches `searches_of` gives call it)
    # one search per dtype (the optimizer-sharding search, a second one per dtype where it may pay, is off here)
    plan = _plan(files["mixed"], tmp_path / "auto.json", "--dtype", "auto", "--shard-optimizer", "off")
    assert calls == ["bf16", "fp16"]  # planned twice, no more
    assert plan.inputs.train.dtype == "fp16"
    used = {r.device.split("/")[0] for r in plan.ranks()}
    assert {"node1", "node2"} <= used  # the V100 nodes compute fp16 on their tensor cores
    reason = plan.inputs.dtype_reason
    assert reason.startswith("V100-16G lacks bf16: the bf16 plan ")
    figures = {d: float(n.replace(",", "")) for d, n in re.findall(r"(fp16|bf16): ([\d,]+) tokens/s", reason)}
    fp16, bf16 = figures["fp16"], figures["bf16"]
    assert fp16 == pytest.approx(plan.predicted["tokens_per_s"], rel=1e-5) and fp16 > bf16
    out = capsys.readouterr().out
    assert "dtype fp16 (chosen by --dtype auto): V100-16G lacks bf16" in out
    # show prints the dtype and why, from the plan file alone
    assert main(["show", str(tmp_path / "auto.json")]) == 0
    assert "dtype fp16 (chosen by --dtype auto)" in capsys.readouterr().out


def test_auto_picks_bf16_when_every_device_computes_it_and_plans_once(files: dict[str, Path], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = driver.plan_layout
    monkeypatch.setattr(driver, "plan_layout", lambda *a, **k: (calls.append(a[2].dtype), original(*a, **k))[1])
    auto = _plan(files["a100"], tmp_path / "auto.json", "--dtype", "auto", "--shard-optimizer", "off")
    assert calls == ["bf16"]
    assert auto.inputs.train.dtype == "bf16" and auto.inputs.dtype_reason == "every device computes bf16 natively"
    explicit = _plan(files["a100"], tmp_path / "bf16.json", "--dtype", "bf16", "--shard-optimizer", "off")
    assert "dtype_reason" not in (tmp_path / "bf16.json").read_text()  # explicit dtypes: the plan as before
    strip = {**json.loads(auto.to_json())}
    del strip["inputs"]["dtype_reason"]
    assert strip == json.loads(explicit.to_json())


def test_auto_is_deterministic(files: dict[str, Path], tmp_path: Path) -> None:
    _plan(files["mixed"], tmp_path / "a.json", "--dtype", "auto")
    _plan(files["mixed"], tmp_path / "b.json", "--dtype", "auto")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_devices_left_idle_in_bf16_say_they_lack_it(tmp_path: Path) -> None:
    """A100 nodes beside a T4 node: in bf16 the T4s compute at their fp32 rate (8.1 TFLOP/s against the A100s'
    312), so they are left idle, and their reason says why and that fp16 would use their tensor cores."""
    path = tmp_path / "a100-t4.json"
    save_cluster(path, build_cluster("2x8xA100-80G-SXM:nic=ib,1x8xT4:nic=ib", name="a100-t4"))
    plan = _plan(path, tmp_path / "plan.json", "--model", "llama-1b", "--global-batch", "128")
    t4 = [u for u in plan.unused_devices if u.device.startswith("node2/")]
    assert len(t4) == 8, "the T4s are left idle in bf16 (their fp32 rate does not pay beside the A100s)"
    assert all("T4 lacks bf16: costed at no more than the fp32 rate (fp16 is native there: --dtype auto weighs it)"
               in u.reason for u in t4)


# ---- the choice itself ---------------------------------------------------------------------------------
def _trial(cluster: Cluster, dtype: str, tokens: float, per_million: float | None = None) -> DtypeTrial:
    train = TrainConfig(global_batch=4, seq_len=128, dtype=dtype)
    used = plan(cluster, PRESETS["llama-small"], train, [(4, [stage(["node0/0"], 0, 4), stage(["node1/0"], 4, 8)])])
    return DtypeTrial(dtype, used, tokens, per_million)


def test_a_tie_keeps_bf16_and_cost_compares_money_per_token() -> None:
    c = cluster(("A100-80G-SXM", 1, "ib", "nvlink"), ("V100-16G", 1, "ib", "nvlink"))
    tie = {"bf16": _trial(c, "bf16", 100.0), "fp16": _trial(c, "fp16", 100.0)}
    best, reason = choose_dtype(c, c.device_ids, tie.__getitem__)
    assert best.dtype == "bf16"
    assert reason == ("V100-16G lacks bf16: the bf16 plan uses them at no more than their fp32 rate; "
                      "bf16: 100 tokens/s, fp16: 100 tokens/s")
    money = {"bf16": _trial(c, "bf16", 100.0, 2.0), "fp16": _trial(c, "fp16", 90.0, 1.5)}
    assert choose_dtype(c, c.device_ids, money.__getitem__, "throughput")[0].dtype == "bf16"
    best, reason = choose_dtype(c, c.device_ids, money.__getitem__, "cost", "USD")
    assert best.dtype == "fp16" and "fp16: USD 1.5 per million tokens, bf16: USD 2 per million tokens" in reason


def test_a_dtype_that_cannot_be_planned_loses_and_two_failures_raise_the_bf16_one() -> None:
    c = cluster(("A100-80G-SXM", 1, "ib", "nvlink"), ("V100-16G", 1, "ib", "nvlink"))

    def only_fp16(dtype: str) -> DtypeTrial:
        if dtype == "bf16":
            raise InfeasibleError("no layout of llama-small fits")
        return _trial(c, dtype, 50.0)

    best, reason = choose_dtype(c, c.device_ids, only_fp16)
    assert best.dtype == "fp16" and "bf16: no plan (no layout of llama-small fits)" in reason

    def neither(dtype: str) -> DtypeTrial:
        raise InfeasibleError(f"nothing fits in {dtype}")

    with pytest.raises(InfeasibleError, match="nothing fits in bf16"):
        choose_dtype(c, c.device_ids, neither)


def test_an_unknown_dtype_is_one_line_and_exit_2(files: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "never.json"
    assert main(["plan", str(files["a100"]), *ARGS, "--dtype", "fp8", "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "error: --dtype must be one of bf16, fp16, fp32, tf32, auto, got 'fp8'"
    assert not out.exists()

"""`flashflex plan --shard-optimizer auto|on|off` (planner/search/sharding.py) and the cost model's sharded terms
(cost/memory.py, cost/optimizer_shards.py): a sharded plan records its per-rank weights and why, deterministically;
each stage is charged its own shard of the optimizer state; `show` and `diff` say how the state is kept; bad
input is one line and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.cost.estimate import estimate, stage_optimizer_shards
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.plan.schema import Plan, load_plan

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "profiles" / "cpu-emulated.json"
ARGS = ["--model", "llama-small", "--global-batch", "16", "--seq-len", "128", "--dtype", "fp32", "--seed", "0",
        "--no-baseline", "--jobs", "1"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("sharding")
    files = {}
    for mode in ("on", "off"):
        files[mode] = out / f"{mode}.json"
        assert main(["plan", str(CLUSTER), *ARGS, "--shard-optimizer", mode, "--out", str(files[mode])]) == 0
    files["again"] = out / "again.json"
    assert main(["plan", str(CLUSTER), *ARGS, "--shard-optimizer", "on", "--out", str(files["again"])]) == 0
    return files


def test_on_shards_with_weights_and_why_deterministically(planned: dict[str, Path]) -> None:
    plan = load_plan(planned["on"])
    assert plan.optimizer_sharding is not None and plan.optimizer_sharding.weights
    assert len(plan.optimizer_sharding.weights) == plan.world_size
    assert "without sharding" in (plan.optimizer_sharding.reason or "")
    assert planned["on"].read_bytes() == planned["again"].read_bytes()
    assert load_plan(planned["off"]).optimizer_sharding is None
    assert "optimizer_sharding" not in planned["off"].read_text()


def test_each_stage_is_charged_its_shard(planned: dict[str, Path]) -> None:
    cluster = load_cluster(CLUSTER)
    plan = load_plan(planned["on"])
    unsharded = plan.model_copy(update={"optimizer_sharding": None})
    shards = stage_optimizer_shards(plan)
    sharded_est, plain_est = estimate(plan, cluster), estimate(unsharded, cluster)
    for with_shard, without in zip(sharded_est.stages, plain_est.stages, strict=True):
        counts = shards[(with_shard.pipeline, with_shard.stage)]
        saved = (counts.held - counts.own) * 8.0  # AdamW's two fp32 moments per element it no longer keeps
        assert without.memory.optimizer - with_shard.memory.optimizer == pytest.approx(saved)
        assert with_shard.optimizer_s <= without.optimizer_s


def test_show_and_diff_render_the_sharding(planned: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(planned["on"])]) == 0
    assert "optimizer state: sharded across each slice's data-parallel holders" in capsys.readouterr().out
    assert main(["diff", str(planned["off"]), str(planned["on"])]) == 0
    assert "optimizer state: not sharded -> sharded" in capsys.readouterr().out


def test_bad_mode_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(CLUSTER), *ARGS, "--shard-optimizer", "sometimes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--shard-optimizer must be one of auto, on, off" in err[0]


def test_plan_weights_must_match_the_ranks(planned: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(Plan.model_validate_json(planned["off"].read_text()).to_json().replace(
        '"pipelines"', '"optimizer_sharding": {"weights": [1]},\n  "pipelines"', 1))
    assert main(["show", str(bad)]) == 2
    assert "optimizer_sharding.weights has 1 entries" in capsys.readouterr().err

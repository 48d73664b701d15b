"""A plan with a micro-batch count or size no run could have is refused by name where it is read: `show`,
`diff` and `launch` answer with one line and exit 2, before anything simulates its schedule (which steps through
every micro-batch) or touches a run folder."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.cost import schedule
from flashflex_cli.errors import InputError
from flashflex_cli.physical_limits import MICRO_BATCHES
from flashflex_cli.plan.schema import load_plan

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = GOLDEN / "cluster-2node.json"


def _no_simulation(*args: object, **kwargs: object) -> None:
    raise AssertionError("the schedule was simulated before the plan was refused")


@pytest.fixture(autouse=True)
def simulation_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing may loop over the count: simulating the schedule fails the test instead of taking minutes."""
    monkeypatch.setattr(schedule, "_simulate", _no_simulation)
    monkeypatch.setattr("flashflex_cli.cost.estimate.simulate_1f1b", _no_simulation)


def _absurd(tmp_path: Path, micro_batch_size: int, num_micro_batches: int, seq_len: int | None = None) -> Path:
    """The golden one-rank plan with one pipeline of `num_micro_batches` micro-batches of `micro_batch_size`."""
    data = json.loads((GOLDEN / "plan-1rank.json").read_text())
    data["pipelines"][0].update(micro_batch_size=micro_batch_size, num_micro_batches=num_micro_batches)
    data["inputs"]["train"]["global_batch"] = micro_batch_size * num_micro_batches
    if seq_len is not None:
        data["inputs"]["train"]["seq_len"] = seq_len
    path = tmp_path / "absurd.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("micro_batch_size", "num_micro_batches", "seq_len", "named"), [
    (1, MICRO_BATCHES.high + 1, None, "pipelines.0.num_micro_batches: must be in [1, 65536] micro-batches"),
    (1, 10**6, None, "pipelines.0.num_micro_batches"),
    (1, 10**9, None, "must be in [1, 16777216] sequences, got 1000000000"),  # beyond any batch as well
    (2**24, 1, 2**24, "pipelines.0: micro_batch_size 16777216 x seq_len 16777216 tokens hold"),
])
def test_an_absurd_micro_batch_plan_is_refused_before_any_simulation(tmp_path: Path, micro_batch_size: int,
                                                                     num_micro_batches: int, seq_len: int | None,
                                                                     named: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path = _absurd(tmp_path, micro_batch_size, num_micro_batches, seq_len)
    with pytest.raises(InputError, match=re.escape(named)):  # the plan's validation, by its error type
        load_plan(path)
    run = tmp_path / "run"
    for argv in (["show", str(path), "--cluster", str(CLUSTER)], ["diff", str(path), str(path)],
                 ["launch", str(path), "--cluster", str(CLUSTER), "--out", str(run), "--launcher", "torchrun"],
                 ["launch", str(path), "--cluster", str(CLUSTER), "--out", str(run), "--dry-run"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and named in err, (argv, err)
    assert not run.exists()


def test_the_largest_allowed_count_still_loads(tmp_path: Path) -> None:
    assert load_plan(_absurd(tmp_path, 1, MICRO_BATCHES.high)).pipelines[0].num_micro_batches == MICRO_BATCHES.high

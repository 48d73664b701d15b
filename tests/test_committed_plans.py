"""plans/ holds one plan per bundled profile; re-planning must reproduce each byte for byte.

This is what CI runs as a dry-run plan diff: a change to the planner or the cost model that alters a
committed plan fails here (regenerate with `make plans` and review the diff), and `flashflex diff
--fail-on-regression 0` reports whether predicted throughput fell.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.plan.schema import load_plan

REPO = Path(__file__).resolve().parents[1]
PLANS = sorted((REPO / "plans").glob("*.json"))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plans")
    env = dict(os.environ, FLASHFLEX=str(Path(sys.executable).with_name("flashflex")), OMP_NUM_THREADS="1")
    subprocess.run(["bash", str(REPO / "scripts" / "make_plans.sh"), str(out)], check=True, env=env,
                   capture_output=True, text=True, timeout=600)
    return out


def test_every_bundled_profile_has_a_plan() -> None:
    profiles = {p.stem for p in (REPO / "profiles").glob("*.json")}
    assert profiles and profiles <= {p.stem for p in PLANS}
    assert (REPO / "plans" / "cpu-emulated.json").exists()


@pytest.mark.parametrize("committed", PLANS, ids=[p.stem for p in PLANS])
def test_replanning_reproduces_the_committed_plan(committed: Path, fresh: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    new = fresh / committed.name
    assert main(["diff", str(committed), str(new), "--fail-on-regression", "0"]) == 0
    report = capsys.readouterr().err
    assert new.read_bytes() == committed.read_bytes(), f"{committed.name} changed; run `make plans`:\n{report}"


@pytest.mark.parametrize("committed", PLANS, ids=[p.stem for p in PLANS])
def test_committed_plans_validate_on_their_profiles(committed: Path) -> None:
    plan = load_plan(committed)
    profile = REPO / "profiles" / committed.name
    assert plan.predicted is not None and plan.predicted["fits"]
    assert main(["show", str(committed), "--cluster", str(profile)]) == 0

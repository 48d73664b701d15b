"""The test suite's shared worker processes (tests/infra/worker_pool.py): a job sees the test process's environment
of the moment it is sent and a fresh interpreter's random seed, whichever jobs ran in the process before it, and a
failed job's processes are replaced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.infra.worker_pool import WorkerPool


def _record_job(rank: int, out_dir: str, name: str, fail: bool) -> None:
    """Save this process's id, the variable FLASHFLEX_TEST_MARK, and a draw of torch's default generator; then set
    the variable and the seed as a careless job would, and raise if `fail`."""
    seen = {"pid": os.getpid(), "mark": os.environ.get("FLASHFLEX_TEST_MARK"), "draw": torch.rand(3)}
    torch.save(seen, Path(out_dir) / f"{name}-{rank}.pt")
    os.environ["FLASHFLEX_TEST_MARK"] = "left by a job"
    torch.manual_seed(1234)
    if fail:
        raise RuntimeError("failed on purpose")


def test_each_job_starts_from_the_test_process_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(name: str, fail: bool = False) -> list[dict]:
        WorkerPool(2, _record_job).run([(rank, str(tmp_path), name, fail) for rank in range(2)])
        return [torch.load(tmp_path / f"{name}-{rank}.pt") for rank in range(2)]

    monkeypatch.setenv("FLASHFLEX_TEST_MARK", "first")
    first = run("first")
    monkeypatch.setenv("FLASHFLEX_TEST_MARK", "second")
    second = run("second")
    assert [s["pid"] for s in second] == [f["pid"] for f in first]  # the same processes, reused
    assert [s["mark"] for s in first] == ["first"] * 2 and [s["mark"] for s in second] == ["second"] * 2
    for f, s in zip(first, second, strict=True):  # the process's own initial seed, not the last job's
        assert torch.equal(f["draw"], s["draw"])
    with pytest.raises(AssertionError, match="failed on purpose"):
        run("failing", fail=True)
    after = run("after")
    assert not {a["pid"] for a in after} & {f["pid"] for f in first}  # replaced after the failure
    assert [a["mark"] for a in after] == ["second"] * 2

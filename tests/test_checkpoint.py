"""Checkpoints: resharding through full tensors, crash-safe saves, SIGTERM saves, resume equality."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from flashflex_cli.errors import InputError
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.parallel.shards import ShardSpec
from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = str(GOLDEN / "cluster-2node.json")


def _shards(w: torch.Tensor, cuts: list[int]) -> tuple[dict[str, torch.Tensor], dict[str, ShardSpec]]:
    """Split w [4, 6] along dim 1 at `cuts` into separate 'local' tensors, as TP ranks would hold them."""
    tensors, shards = {}, {}
    bounds = [0, *cuts, w.shape[1]]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        name = f"w#{a}"
        tensors[name] = w[:, a:b].clone()
        shards[name] = ShardSpec("w", tuple(w.shape), 1, a, b, True)
    return tensors, shards


def test_save_shards_load_full_tensors(tmp_path: Path, world_of_one: None) -> None:
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors, shards = _shards(w, [2, 5])
    tensors["b"], shards["b"] = torch.ones(3), ShardSpec("b", (3,), None, 0, 3, True)
    tensors["step"], shards["step"] = torch.tensor(7), ShardSpec("step", (), None, 0, 1, True)
    tensors["x"], shards["x"] = torch.zeros(2), ShardSpec("x", (2,), None, 0, 2, False)  # not the owner
    path = ckpt.save(tmp_path, 7, tensors, shards, {"model": {"name": "t"}})
    assert path == tmp_path / "step-000007" and (tmp_path / "latest").read_text().strip() == "step-000007"
    manifest = ckpt.read_manifest(path)
    assert manifest["step"] == 7 and manifest["tensors"]["w"]["shards"] == [[1, 0, 2], [1, 2, 5], [1, 5, 6]]
    assert "x" not in manifest["tensors"]
    full = ckpt.load_full(path, ["w", "b", "step", "missing"])
    assert torch.equal(full["w"], w) and torch.equal(full["b"], torch.ones(3)) and int(full["step"]) == 7
    assert "missing" not in full


def test_load_into_reads_each_slice_from_whatever_shards_were_saved(tmp_path: Path, world_of_one: None) -> None:
    """Targets at other cuts than the saved ones (and the whole tensor) get exactly the full tensor's slice;
    a tensor saved under two layouts (like the embedding at two TP degrees) is read once per piece."""
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors, shards = _shards(w, [2, 5])
    extra, extra_shards = _shards(w, [3])  # the same tensor saved again under another cut
    tensors.update({f"again{k}": v for k, v in extra.items()})
    shards.update({f"again{k}": v for k, v in extra_shards.items()})
    tensors["b"], shards["b"] = torch.arange(3.0), ShardSpec("b", (3,), None, 0, 3, True)
    tensors["step"], shards["step"] = torch.tensor(7), ShardSpec("step", (), None, 0, 1, True)
    path = ckpt.save(tmp_path, 7, tensors, shards, {})
    cuts = [(0, 6), (0, 1), (1, 4), (4, 6), (2, 3), (5, 6)]
    targets = {f"w{a}:{b}": (ShardSpec("w", (4, 6), 1, a, b, False), torch.full((4, b - a), -1.0)) for a, b in cuts}
    targets["whole"] = (ShardSpec("w", (4, 6), None, 0, 4, False), torch.zeros(4, 6))
    targets["b1"] = (ShardSpec("b", (3,), 0, 1, 3, False), torch.zeros(2))
    targets["step"] = (ShardSpec("step", (), None, 0, 1, False), torch.tensor(0))
    targets["b64"] = (ShardSpec("b", (3,), None, 0, 3, False), torch.zeros(3, dtype=torch.float64))  # DCP's read
    ckpt.load_into(path, targets)
    assert torch.equal(targets["b64"][1], torch.arange(3.0, dtype=torch.float64))
    for a, b in cuts:
        assert torch.equal(targets[f"w{a}:{b}"][1], w[:, a:b])
    assert torch.equal(targets["whole"][1], w) and torch.equal(targets["b1"][1], torch.tensor([1.0, 2.0]))
    assert int(targets["step"][1]) == 7
    table = ckpt.read_manifest(path)["tensors"]
    pieces = ckpt.plan_reads(table, {"x": targets["w1:4"]}, "here")
    assert [p[3:5] for p in pieces] == [(0, 2), (2, 3)]  # [1, 3) from the 0:3 shard, [3, 4) from 3:6: no re-read
    with pytest.raises(InputError, match="no tensor missing"):
        ckpt.load_into(path, {"m": (ShardSpec("missing", (2,), None, 0, 2, False), torch.zeros(2))})
    with pytest.raises(InputError, match="checkpoint shape"):
        ckpt.load_into(path, {"w": (ShardSpec("w", (4, 7), 1, 0, 7, False), torch.zeros(4, 7))})


def test_crash_during_save_keeps_previous_checkpoint(tmp_path: Path, world_of_one: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(4, 6)
    tensors, shards = _shards(w, [3])
    ckpt.save(tmp_path, 1, tensors, shards, {})
    real_save = ckpt.dcp.save

    def crash(state, checkpoint_id, process_group=None):  # writes part of the files, then dies
        Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(ckpt.dcp, "save", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        ckpt.save(tmp_path, 2, {k: v * 0 for k, v in tensors.items()}, shards, {})
    assert (tmp_path / "step-000002.tmp").exists() and not (tmp_path / "step-000002").exists()
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    assert torch.equal(ckpt.load_full(ckpt.latest_checkpoint(tmp_path), ["w"])["w"], w)
    (tmp_path / "latest").unlink()  # even without the pointer, the newest complete folder is found
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step-000001"
    monkeypatch.setattr(ckpt.dcp, "save", real_save)
    for step in (3, 4, 5):
        ckpt.save(tmp_path, step, tensors, shards, {})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["latest", "step-000004", "step-000005"]  # stale .tmp removed, two newest kept


@pytest.mark.parametrize("plan_name", ["plan-3rank.json", "plan-4rank.json"])
def test_owned_shards_cover_every_full_tensor_and_each_is_written_once(plan_name: str) -> None:
    from flashflex_cli.plan.schema import load_plan
    from flashflex_cli.runtime.training.engine import plan_shard_specs

    plan = load_plan(GOLDEN / plan_name)
    cover: dict[str, torch.Tensor] = {}
    writers: dict[str, int] = {}
    for rank in range(plan.world_size):
        specs = plan_shard_specs(plan, rank)
        state = {}
        for spec in specs:
            shape = list(spec.full_shape)
            if spec.dim is not None:
                shape[spec.dim] = spec.stop - spec.start
            for key in (spec.name, f"{spec.name}.exp_avg", f"{spec.name}.exp_avg_sq"):
                state[key] = torch.zeros(shape)
        state["step"] = torch.tensor(0)
        shards = ckpt.shards_for(state, specs, rank)
        assert shards["step"].owner == (rank == 0) and shards["step"].key == "step@full"
        for key, shard in shards.items():
            if not shard.owner or key == "step":
                continue
            assert shard.key not in writers, f"{shard.key} written by ranks {writers[shard.key]} and {rank}"
            writers[shard.key] = rank
            full = cover.setdefault(key, torch.zeros(shard.full_shape))
            (full if shard.dim is None else full.narrow(shard.dim, shard.start, shard.stop - shard.start)).add_(1)
    # nothing missing (a slice held at two TP degrees, like the embedding under TP 2 and TP 1, is saved per layout)
    assert cover and all(bool(torch.all(c >= 1)) for c in cover.values())
    assert len(cover) == 3 * len({s.name for r in range(plan.world_size) for s in plan_shard_specs(plan, r)})


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def _launch(plan: str, out: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([FLASHFLEX, "launch", str(GOLDEN / plan), "--cluster", CLUSTER, "--out", str(out),
                           "--timeout", "30", *extra], capture_output=True, text=True, timeout=240,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_sigterm_saves_then_resume_continues_the_same_losses(tmp_path: Path) -> None:
    reference = _launch("plan-3rank.json", tmp_path / "ref", "--steps", "20")
    assert reference.returncode == 0, reference.stderr
    expected = _losses(tmp_path / "ref")
    run, ck = tmp_path / "run", tmp_path / "ck"
    # a long run on the same 20-step learning-rate schedule, stopped by SIGTERM after its second step
    proc = subprocess.Popen([FLASHFLEX, "launch", str(GOLDEN / "plan-3rank.json"), "--cluster", CLUSTER, "--out",
                             str(run), "--steps", "1000", "--schedule-steps", "20", "--checkpoint-dir", str(ck)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM: stopped after step" in err and "stopped by SIGTERM" in err and "Traceback" not in err
    saved = ckpt.latest_checkpoint(ck)
    assert saved is not None
    step = ckpt.read_manifest(saved)["step"]
    assert 2 <= step < 20 and len(_losses(run)) == step
    resumed = _launch("plan-3rank.json", run, "--steps", "20", "--checkpoint-dir", str(ck), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {saved} at step {step}" in resumed.stderr
    losses = _losses(run)
    assert sorted(losses) == list(range(1, 21))
    for k in range(1, 21):
        assert losses[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-6), k

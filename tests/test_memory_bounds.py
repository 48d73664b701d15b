"""Memory that scales: a rank initialises and resumes within about twice its own model and optimizer state.

- `shard_init` gives each shard bit-identical to `full_init` sliced, without building the full tensor.
- Ranks of a plan whose full model state does not fit the bound (a large vocabulary under TP 4) initialise and
  resume, from a checkpoint written under another plan, with a peak RSS growth of at most
  2 x (own params + 2 AdamW moments) + ALLOWANCE, measured in fresh processes (one per rank, so nothing of
  earlier tests counts), and resume to exactly the saved values.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashflex_cli.model.spec import ModelSpec
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.model.init import block_draw_is_exact, full_init, shard_init
from flashflex_cli.semantics.parameters import stage_params
from tests.conftest import REPO
from tests.test_parity import make_plan

MiB = 1 << 20
# Fixed allowance for what a rank allocates besides its tensors once the baseline is taken (torch, DCP and the
# process group are imported and set up, and torch's random kernels warmed up, before it): gloo buffers of the
# first collectives, module objects, shard_init's 1 MiB draw block and scratch, DCP's pickled plans and
# metadata, allocator slack. Measured with this test's flow on 4 ranks: 1.2-11.3 MiB beyond the parameters
# during init (varying between runs and ranks), 0-2.1 MiB beyond the moments during resume. ALLOWANCE stays
# below one full tensor here (32 MiB each for the embedding and the head), so init building any full tensor
# fails; RESUME_SLACK stays below one saved shard (16 MiB), so resume holding a whole saved shard fails.
ALLOWANCE = 24 * MiB
RESUME_SLACK = 8 * MiB

# Big vocabulary, small layers: the embedding and head are 32 MiB each, 98% of the parameters.
SPEC = ModelSpec(name="wide-vocab", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4,
                 intermediate_size=256, vocab_size=65536)


def test_shard_init_is_bit_identical_to_the_full_draw_sliced() -> None:
    """Every split of every kind of tensor (dim 0 and 1, sizes not a multiple of 16, tiny blocks) equals the
    slice of the full tensor bit for bit, so initial weights stay plan-independent and unchanged."""
    assert block_draw_is_exact()  # on the pinned torch the block draw is used, not the full-draw fallback
    rng = random.Random(0)
    cases = [("embed", (1000, 64)), ("layers.0.attn.wo", (64, 96)), ("layers.1.mlp.w_down", (37, 5)),
             ("head", (1001, 3)), ("layers.0.attn.wq", (3, 5)), ("layers.0.attn.bq", (33,)),
             ("layers.0.attn_norm", (64,)), ("x", (7, 9, 11))]
    for name, shape in cases:
        full = full_init(SPEC, name, shape, seed=5)
        for dim in range(len(shape)):
            for _ in range(5):
                a = rng.randrange(shape[dim])
                b = rng.randrange(a, shape[dim]) + 1
                for block in (16, 48, 1 << 18):
                    got = shard_init(SPEC, name, shape, 5, dim, a, b, block=block)
                    assert got.is_contiguous()
                    assert torch.equal(got, full.narrow(dim, a, b - a)), (name, shape, dim, a, b, block)
    embed = full_init(SPEC, "embed", (SPEC.vocab_size, SPEC.hidden_size), seed=5)  # the real size: 8 Mi values
    for a, b in ((0, 16384), (49152, 65536), (100, 101)):
        param = torch.empty(b - a, SPEC.hidden_size)  # drawn straight into the parameter, as RankEngine does
        assert shard_init(SPEC, "embed", tuple(embed.shape), 5, 0, a, b, out=param) is param
        assert torch.equal(param, embed[a:b])
    target = torch.empty(SPEC.hidden_size, 40).t()  # a non-contiguous target is filled through a copy
    shard_init(SPEC, "head", (1000, SPEC.hidden_size), 5, 0, 960, 1000, out=target)
    assert torch.equal(target, full_init(SPEC, "head", (1000, SPEC.hidden_size), seed=5)[960:])


RANK_SCRIPT = r"""
import json, sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # library code is loaded before the baseline: it is not the rank's state
import torch._dynamo  # (so is what torch.optim.AdamW's constructor imports: torch._dynamo, ~70 MiB of code)

from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.model.init import shard_init

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

rank, world, plan_file, store, ck, out = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=120))
plan = Plan.model_validate_json(Path(plan_file).read_text())
groups = build_groups(plan, rank)
optim = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, total_steps=10)
# one-time set-up of torch's random kernels (~10 MiB of buffers and code pages, whatever the model size)
shard_init(plan.inputs.model, "embed", (64, 64), 0, 0, 0, 16)
dist.barrier()
before = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
engine = RankEngine(plan, rank, groups, torch.device("cpu"), optim, seed=11)
init_growth = status("VmHWM") - before
after_init = status("VmRSS")
Path("/proc/self/clear_refs").write_text("5")
found = ckpt.latest_checkpoint(ck)
engine.load_local(lambda targets: ckpt.load_into(found, targets))
resume_growth = status("VmHWM") - after_init
own = sum(p.numel() * p.element_size() for _, p in engine.params.values())
Path(out, f"mem{rank}.json").write_text(json.dumps({
    "init": init_growth, "resume": resume_growth, "total": max(init_growth, after_init - before + resume_growth),
    "own_params": own, "step": engine.step}))
full = engine.gather_full_state()
if rank == 0:
    torch.save(full, Path(out, "resumed.pt"))
dist.barrier()
dist.destroy_process_group()
"""


def _save_as(plan: Plan, root: Path, full: dict[str, torch.Tensor]) -> None:
    """Write the checkpoint every rank of `plan` would write for the full state `full`, from this process
    (a one-process group; each rank's owned shards under their usual keys)."""
    from flashflex_cli.runtime.checkpoint import dcp as ckpt
    from flashflex_cli.runtime.training.engine import plan_shard_specs

    tensors: dict[str, torch.Tensor] = {}
    shards = {}
    for rank in range(plan.world_size):
        specs = plan_shard_specs(plan, rank)
        state = {key: spec.take(full[key]) for spec in specs
                 for key in (spec.name, f"{spec.name}.exp_avg", f"{spec.name}.exp_avg_sq")}
        state["step"] = full["step"]
        for key, shard in ckpt.shards_for(state, specs, rank).items():
            tensors[f"{rank}/{key}"], shards[f"{rank}/{key}"] = state[key], shard
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ckpt.save(root, int(full["step"]), tensors, shards, {})
    finally:
        dist.destroy_process_group()



def _run_ranks(plan: Plan, tmp_path: Path) -> None:
    """One fresh interpreter per rank running RANK_SCRIPT over a gloo group."""
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.to_json())
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(rank), str(plan.world_size), str(plan_file),
                               str(tmp_path / "store"), str(tmp_path / "ck"), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(plan.world_size)]
    errors = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
        if proc.returncode != 0:
            errors.append(f"rank {rank}: exit {proc.returncode}\n{err[-3000:]}")
    assert not errors, "\n".join(errors)


def test_init_and_resume_under_another_plan_stay_within_twice_the_ranks_state(tmp_path: Path) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    # saved as 2 stages x TP 2 would save it (the embedding and head in halves), resumed by one stage of TP 4
    saver = make_plan(SPEC, [(1, 2, [(2, (0, 1)), (2, (1, 2))])])
    loader = make_plan(SPEC, [(1, 2, [(4, (0, 2))])])
    gen = torch.Generator().manual_seed(0)
    full: dict[str, torch.Tensor] = {}
    for info in stage_params(SPEC, (0, SPEC.num_layers), True, True):
        for key in (info.name, f"{info.name}.exp_avg", f"{info.name}.exp_avg_sq"):
            full[key] = torch.randn(info.shape, generator=gen)
    full["step"] = torch.tensor(1)
    _save_as(saver, tmp_path / "ck", full)
    _run_ranks(loader, tmp_path)

    resumed = torch.load(tmp_path / "resumed.pt")  # rank 0's TP group gathered every tensor
    assert set(resumed) == set(full) | {"optimizer_steps"}  # absent from this checkpoint: one update per step
    assert int(resumed.pop("optimizer_steps")) == 1
    for key, value in resumed.items():
        assert torch.equal(value, full[key]), key  # a copy of the saved values: exact

    param_bytes = 4 * sum(v.numel() for k, v in full.items() if k != "step" and not k.endswith("exp_avg_sq")
                          and not k.endswith("exp_avg"))
    for rank in range(loader.world_size):
        mem = json.loads((tmp_path / f"mem{rank}.json").read_text())
        assert mem["step"] == 1
        state = 3 * mem["own_params"]  # fp32 params + AdamW exp_avg + exp_avg_sq
        bound = 2 * state + ALLOWANCE
        assert 3 * param_bytes > bound  # the whole model's state would not fit: the bound has teeth
        assert mem["total"] <= bound, f"rank {rank}: peak grew {mem['total'] / MiB:.1f} MiB > {bound / MiB:.1f}"
        # init holds only the shards (plus one draw block): never a full 32 MiB tensor
        assert mem["init"] <= mem["own_params"] + ALLOWANCE, f"rank {rank}: init grew {mem['init'] / MiB:.1f} MiB"
        # resume adds the two moments and reads only the overlaps: no whole saved shard (16 MiB) is held
        assert mem["resume"] <= 2 * mem["own_params"] + RESUME_SLACK, \
            f"rank {rank}: resume grew {mem['resume'] / MiB:.1f} MiB"

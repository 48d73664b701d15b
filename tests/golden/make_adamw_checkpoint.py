"""Write tests/golden/adamw-ckpt/: a checkpoint of a tiny one-rank run and what that run did next.

The committed folder was written by the runtime as it was before it used torch.optim.AdamW (its own
multi-tensor AdamW; flashflex commit 32de13d), by running this script with that version on the path:

    PYTHONPATH=<old checkout>/src python tests/golden/make_adamw_checkpoint.py tests/golden/adamw-ckpt

It trains STEPS_BEFORE optimizer steps, saves a checkpoint (step-000002/, the format `flashflex launch
--checkpoint-dir` writes), trains STEPS_AFTER more and stores their losses and the final parameters in
continuation.pt. tests/test_optimizer.py resumes the checkpoint with today's runtime and must continue the same
way. Only APIs that both versions have are used.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from flashflex_cli.model.spec import ModelSpec
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.checkpoint import dcp as ckpt
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine

SPEC = ModelSpec(name="adamw-golden", hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=2,
                 intermediate_size=32, vocab_size=32)
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=1, total_steps=8, weight_decay=0.1, grad_clip=1.0)
SEQ, BATCH, SEED = 8, 2, 5
STEPS_BEFORE, STEPS_AFTER = 2, 2


def plan() -> Plan:
    """One rank, one stage holding both layers, two micro-batches of one sequence."""
    return Plan.model_validate({
        "schema": "flashflex.plan/1",
        "inputs": {"cluster_sha256": "golden", "model": SPEC.model_dump(),
                   "train": {"global_batch": BATCH, "seq_len": SEQ, "dtype": "fp32"}},
        "pipelines": [{"micro_batch_size": 1, "num_micro_batches": BATCH,
                       "stages": [{"devices": ["cpu0/0"], "tp": 1, "layers": [0, SPEC.num_layers]}]}],
    })


def batches() -> list[torch.Tensor]:
    """The token batches int64 [BATCH, SEQ + 1] of every step."""
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, SPEC.vocab_size, (BATCH, SEQ + 1), generator=gen)
            for _ in range(STEPS_BEFORE + STEPS_AFTER)]


def main(out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    the_plan = plan()
    engine = RankEngine(the_plan, 0, build_groups(the_plan, 0), torch.device("cpu"), OPTIM, seed=SEED)
    data = batches()
    for batch in data[:STEPS_BEFORE]:
        engine.train_step(batch)
    state = engine.state_for_checkpoint()
    ckpt.save(out, STEPS_BEFORE, state, ckpt.shards_for(state, engine.shard_specs(), 0), {"model": SPEC.model_dump()})
    losses = [engine.train_step(batch).loss for batch in data[STEPS_BEFORE:]]
    torch.save({"losses": losses, "params": engine.gather_full_params()}, out / "continuation.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

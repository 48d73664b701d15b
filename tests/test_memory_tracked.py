"""The cost model's memory follows the runtime: every rank of real multi-process plans (gloo, CPU) trains a few
steps under PyTorch's tensor accounting (tests/infra/tensor_accounting.py), and the peak of live tensor bytes
over the steady steps is within 3% of the allocated peak cost/memory.py predicts for its stage.

The plans cover first, middle and last stages, TP degrees 1 and 2 with changes at stage boundaries, unlike
pipelines reducing their gradients together, fp32 / bf16 / fp16 autocast, SDPA and eager attention (and a
sliding window), activation recompute, tied embeddings, and the chunked loss (the default) beside the loss over
the whole vocabulary. The shapes keep activations a large share of each
stage's peak, so a miscounted saved tensor or temporary moves the figure, not only the model states.
Tolerance: 3% (the issue's bound). The counts are exact to the byte for single parts (checked in
test_cost_activations.py); what is left here is the step's small bookkeeping (loss scalars, gradient-norm
partials, index tensors) and, on CPU only, gloo keeping the buffers of a rank's last transfer until its next one
(up to two [tokens, hidden] tensors on a stage that receives through an all-gather; NCCL releases them once a
transfer is waited for). Worst seen: +1.5% (the last stage of "bf16-window").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.cluster import Cluster
from flashflex_cli.model.spec import PRESETS, ModelSpec
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.engine import OptimConfig, RankEngine
from flashflex_cli.runtime.groups import build_groups
from flashflex_cli.semantics.runtime_paths import RuntimeOptions
from tests.infra.tensor_accounting import TensorAccounting
from tests.infra.worker_pool import WorkerPool, gloo_rank

TOLERANCE = 0.03
STEPS = 3  # the first step creates the optimizer's moments; the peak is taken over the later ones
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=2, total_steps=10)
CHUNK = 48  # tokens per chunk of the chunked loss: several chunks at these shapes (the runtime's rule gives one)


def _plan(model: ModelSpec, pipelines: list[tuple[int, int, list[tuple[int, tuple[int, int]]]]], seq: int,
          dtype: str, attention: str = "sdpa", recompute: bool = False) -> Plan:
    """A plan on node "cpu0" from [(micro_batch_size, micro-batches, [(tp, (first, end layer)), ...]), ...]."""
    device = 0
    pipes: list[dict[str, Any]] = []
    for mbs, nmb, stages in pipelines:
        rows = []
        for tp, layers in stages:
            rows.append({"devices": [f"cpu0/{device + t}" for t in range(tp)], "tp": tp, "layers": list(layers)})
            device += tp
        pipes.append({"micro_batch_size": mbs, "num_micro_batches": nmb, "stages": rows})
    batch = sum(mbs * nmb for mbs, nmb, _ in pipelines)
    return Plan.model_validate({
        "schema": "flashflex.plan/1",
        "inputs": {"cluster_sha256": "test", "model": model.model_dump(),
                   "train": {"global_batch": batch, "seq_len": seq, "dtype": dtype, "attention": attention,
                             "recompute": recompute}},
        "pipelines": pipes,
    })


def _cluster(devices: int) -> Cluster:
    return Cluster.model_validate({"name": "tracked", "nodes": [{
        "name": "cpu0", "devices": [{"type": "cpu", "memory_bytes": 8 * 2**30, "peak_flops": {"fp32": 1e11},
                                     "memory_bandwidth": 2e10}] * devices, "intra_link": {"kind": "shm"}}]})


SMALL = PRESETS["llama-small"]  # h 256, 8 layers, 8 heads / 4 kv heads, MLP 688
WIDE_VOCAB = SMALL.model_copy(update={"vocab_size": 2048})
MISTRAL = SMALL.model_copy(update={"family": "mistral", "sliding_window": 48, "num_layers": 4})

PLANS: dict[str, Plan] = {
    # first / middle / last stages, TP 2 -> 1 -> 2, beside a one-stage pipeline: DP across unlike pipelines;
    # the loss over the whole vocabulary (the path of runs before the chunked loss)
    "fp32-sdpa-asymmetric-unchunked": _plan(WIDE_VOCAB, [(2, 3, [(2, (0, 3)), (1, (3, 6)), (2, (6, 8))]),
                                               (2, 2, [(1, (0, 8))])], seq=64, dtype="fp32"),
    # bf16 under autocast, eager attention, tied embeddings held by the first and the last stage
    "bf16-eager-tied": _plan(WIDE_VOCAB.model_copy(update={"tie_embeddings": True}),
                             [(2, 3, [(1, (0, 4)), (2, (4, 8))]), (1, 2, [(2, (0, 5)), (1, (5, 8))])],
                             seq=64, dtype="bf16", attention="eager"),
    # activation recompute in fp16, a longer sequence, three stages of TP 1
    "fp16-recompute": _plan(WIDE_VOCAB, [(2, 4, [(1, (0, 3)), (1, (3, 6)), (1, (6, 8))])], seq=128, dtype="fp16",
                            recompute=True),
    # a sliding window (Mistral) with SDPA and with the eager path, bf16, TP 2 then 1
    "bf16-window": _plan(MISTRAL, [(2, 2, [(2, (0, 2)), (1, (2, 4))])], seq=128, dtype="bf16"),
    "fp32-window-eager": _plan(MISTRAL, [(2, 3, [(1, (0, 2)), (2, (2, 4))])], seq=128, dtype="fp32",
                               attention="eager"),
}


def _options(name: str) -> RuntimeOptions:
    """The runtime's CPU defaults (chunked loss, multi-tensor AdamW, eager), unchunked where the plan says."""
    return RuntimeOptions(chunked_loss="unchunked" not in name)


def _job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str, name: str) -> None:
    """Train STEPS steps of the plan on `rank` under tensor accounting; save the peak of the later steps."""
    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        groups = build_groups(plan, rank)
        train, vocab = plan.inputs.train, plan.inputs.model.vocab_size
        generator = torch.Generator().manual_seed(5)
        batches = [torch.randint(0, vocab, (train.global_batch, train.seq_len + 1), generator=generator)
                   for _ in range(STEPS)]
        with TensorAccounting() as accounting:
            engine = RankEngine(plan, rank, groups, torch.device("cpu"), OPTIM, seed=3, options=_options(name))
            engine.module.loss_chunk_tokens = CHUNK
            rows = engine.pipeline_slice(train.global_batch)
            engine.train_step(batches[0][rows])
            accounting.reset_peak()
            for batch in batches[1:]:
                engine.train_step(batch[rows])
            peak = accounting.peak_bytes
        torch.save({"peak": peak}, Path(out_dir) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    with WorkerPool(6, _job) as workers:
        yield workers


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_each_stage_peaks_where_the_cost_model_says(name: str, pool: WorkerPool, tmp_path: Path) -> None:
    plan = PLANS[name]
    pool.run([(rank, plan.world_size, plan.to_json(), str(tmp_path / "store"), str(tmp_path), name)
              for rank in range(plan.world_size)])
    params = dataclasses.replace(CostParams(), runtime=_options(name), loss_chunk_tokens=CHUNK)
    predicted = {(st.pipeline, st.stage): st.memory for st in estimate(plan, _cluster(plan.world_size), params).stages}
    lines, worst = [], 0.0
    for info in plan.ranks():
        peak = torch.load(tmp_path / f"rank{info.rank}.pt")["peak"]
        mem = predicted[(info.pipeline, info.stage)]
        error = peak / mem.allocated - 1
        worst = max(worst, abs(error))
        lines.append(f"rank {info.rank} (p{info.pipeline}.s{info.stage}, tp {len(plan.pipelines[info.pipeline].stages[info.stage].devices)}): "
                     f"tracked {peak:,} B, predicted {mem.allocated:,.0f} B ({mem.phase}), {100 * error:+.2f}%")
    assert worst <= TOLERANCE, "\n".join(lines)

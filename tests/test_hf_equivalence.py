"""Equivalence with the reference implementation: for each family (Llama 3.1 with llama3 rotary scaling and an
explicit head_dim, Mistral with a sliding window shorter than the sequence, Qwen2 with q/k/v biases, a Llama
config with tied embeddings written in the transformers 5.x `rope_parameters` form), the same tiny model is
built by `transformers` (test-only dependency) from a config.json and by flashflex from the same file, both
loaded with the same random weights, and the logits, the loss and every gradient of one batch must agree.

flashflex runs each model three ways: one process (TP 1), a one-stage plan at TP 2, and an asymmetric plan
(pipeline 0: a TP-2 stage then a TP-1 stage; pipeline 1: one TP-1 stage), both on gloo processes.

Tolerance: RTOL = 1e-5 of each tensor's largest magnitude (per tensor, not per element: elements that cancel to
near zero keep the rounding of their terms, whose size is the tensor's scale). Both sides compute in fp32 with
other summation orders (transformers' eager attention vs SDPA, TP partial sums, per-pipeline gradient sums) over
reductions of at most 176 terms per matmul and 48 tokens per gradient: rounding of order 1e-7 to 1e-6 of the
scale, so 1e-5 leaves a margin of ten while any modelling difference (a missed bias, window or frequency
remap) shows at 1e-3 or more.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from flashflex_cli.model.hf_config import from_hf_config, to_hf_config
from flashflex_cli.model.spec import ModelSpec
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.model.attention import SDPA
from flashflex_cli.runtime.model.stage import StageModule
from flashflex_cli.runtime.model.tensor_parallel import TPContext
from flashflex_cli.runtime.parallel.groups import build_groups
from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine
from flashflex_cli.semantics.parameters import model_params
from tests.infra.worker_pool import WorkerPool, gloo_rank
from tests.test_parity import _worker as parity_worker
from tests.test_parity import check_parity, make_plan

RTOL = 1e-5
SEQ = 16
BATCH = 3
OPTIM = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=1, total_steps=10, grad_clip=0.0)  # raw gradients
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 176, "vocab_size": 256, "rms_norm_eps": 1e-5}
CONFIGS: dict[str, dict[str, Any]] = {
    # wavelengths of 6, 14, 32+ tokens against original 32 / high 4 / low 1: kept, blended and divided bands
    "llama31": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "head_dim": 32,
                "rope_theta": 500000.0, "max_position_embeddings": 128,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 5,
                "max_position_embeddings": 64},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0},
    "tied": {"model_type": "llama", "tie_word_embeddings": True,
             "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}},
}
PLANS = {
    "one-stage-tp2": [(1, BATCH, [(2, (0, 2))])],
    "asymmetric": [(1, 2, [(2, (0, 1)), (1, (1, 2))]), (1, 1, [(1, (0, 2))])],
}
HF_LAYER = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
            "attn.wq": "self_attn.q_proj.weight", "attn.wk": "self_attn.k_proj.weight",
            "attn.wv": "self_attn.v_proj.weight", "attn.wo": "self_attn.o_proj.weight",
            "attn.bq": "self_attn.q_proj.bias", "attn.bk": "self_attn.k_proj.bias",
            "attn.bv": "self_attn.v_proj.bias", "mlp.w_gate": "mlp.gate_proj.weight",
            "mlp.w_up": "mlp.up_proj.weight", "mlp.w_down": "mlp.down_proj.weight"}


def hf_name(name: str) -> str:
    """The transformers parameter name of a flashflex global parameter name."""
    fixed = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{HF_LAYER[rest]}"


def make_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random full fp32 tensors for every global parameter: norms around 1, biases and weights normal."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for info in model_params(spec):
        noise = torch.randn(info.shape, generator=gen)
        out[info.name] = 1.0 + 0.1 * noise if info.name.endswith("norm") else 0.08 * noise
    return out


def assert_close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """max |got - want| <= RTOL * max |want| (module docstring)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert scale > 0 and err <= RTOL * scale, f"{what}: max error {err:.3e} > {RTOL} x {scale:.3e}"


def reference(config_dir: Path, spec: ModelSpec, weights: dict[str, torch.Tensor],
              tokens: torch.Tensor) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """transformers' model from `config_dir`/config.json with `weights`: logits [B, S, V], mean token loss,
    gradient of every flashflex parameter name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    state = {hf_name(name): w for name, w in weights.items()}
    if spec.tie_embeddings:
        state["lm_head.weight"] = weights["embed"]
    model.load_state_dict(state, strict=True)
    if spec.tie_embeddings:  # one tensor, not two equal ones
        assert model.lm_head.weight is model.model.embed_tokens.weight
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(input_ids=inputs, use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="sum")
    loss = loss / targets.numel()
    loss.backward()
    grads = {name: model.get_parameter(hf_name(name)).grad.detach().clone() for name in weights}
    return logits.detach(), float(loss.detach()), grads


def _rank_job(rank: int, world: int, plan_json: str, init_file: str, inputs: str, out_dir: str) -> None:
    """One rank of a plan: load the shared weights, one train step on the shared batch, save the loss, the
    full gradients and parameters it holds and the logits shards its last stage computed."""
    with gloo_rank(rank, world, init_file, deterministic=False):
        plan = Plan.model_validate_json(plan_json)
        data = torch.load(inputs)
        engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OPTIM)
        full = {**data["weights"], "step": torch.tensor(0)}
        engine.load_from_full(full.__getitem__)
        engine.module.capture_logits = [] if engine.last else None
        result = engine.train_step(data["tokens"][engine.pipeline_slice(BATCH)])
        torch.save({"loss": result.loss, "grads": engine.gather_full_grads(), "params": engine.gather_full_params(),
                    "pipeline": engine.groups.pipeline, "stage": engine.groups.stage, "last": engine.last,
                    "vocab_start": engine.module.vocab_start, "logits": engine.module.capture_logits},
                   Path(out_dir) / f"rank{rank}.pt")


def _any_job(*job: Any) -> None:
    """One pooled job: `_rank_job` (6 fields), or tests/test_parity.py's `_worker` (7 fields), so `check_parity`
    can use this pool too."""
    (parity_worker if len(job) == 7 else _rank_job)(*job)


@pytest.fixture(scope="module")
def pool() -> Iterator[WorkerPool]:
    """Four reusable worker processes (the asymmetric plan has 4 ranks)."""
    with WorkerPool(4, _any_job) as workers:
        yield workers


def _assemble_logits(outputs: list[dict[str, Any]], plan: Plan) -> torch.Tensor:
    """Full logits [B, S, V] from the last stages' vocabulary shards, micro-batches and pipelines in order."""
    pipes = []
    for p, pipe in enumerate(plan.pipelines):
        shards = sorted((o["vocab_start"], o["logits"]) for o in outputs if o["last"] and o["pipeline"] == p)
        micro = [torch.cat([s[m] for _, s in shards], dim=-1) for m in range(pipe.num_micro_batches)]
        pipes.append(torch.cat(micro, dim=0))
    return torch.cat(pipes, dim=0)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_family_matches_transformers(family: str, tmp_path: Path, pool: WorkerPool) -> None:
    config_dir = tmp_path / family
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps({**SHAPE, **CONFIGS[family]}))
    spec = from_hf_config(config_dir / "config.json")
    weights = make_weights(spec, seed=len(family))
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    want_logits, want_loss, want_grads = reference(config_dir, spec, weights, tokens)
    assert set(want_grads) == {info.name for info in model_params(spec)}

    # one process, TP 1: the stage module itself
    module = StageModule(spec, (0, spec.num_layers), True, True, TPContext(group=None), SDPA)
    with torch.no_grad():
        for info, param in module.global_parameters():
            param.copy_(weights[info.name])
    module.capture_logits = []
    loss = module(tokens[:, :-1], tokens[:, 1:]) / (BATCH * SEQ)
    loss.backward()
    assert_close("logits (1 process)", module.capture_logits[0], want_logits)
    assert loss.item() == pytest.approx(want_loss, rel=RTOL)
    for info, param in module.global_parameters():
        assert_close(f"grad {info.name} (1 process)", param.grad, want_grads[info.name])

    torch.save({"weights": weights, "tokens": tokens}, tmp_path / "inputs.pt")
    for label, layout in PLANS.items():
        plan = make_plan(spec, layout, seq_len=SEQ)
        out_dir = tmp_path / label
        out_dir.mkdir()
        pool.run([(rank, plan.world_size, plan.to_json(), str(out_dir / "store"), str(tmp_path / "inputs.pt"),
                   str(out_dir)) for rank in range(plan.world_size)])
        outputs = [torch.load(out_dir / f"rank{r}.pt") for r in range(plan.world_size)]
        assert_close(f"logits ({label})", _assemble_logits(outputs, plan), want_logits)
        seen: set[str] = set()
        for rank, out in enumerate(outputs):
            assert out["loss"] == pytest.approx(want_loss, rel=RTOL), f"{label} rank {rank} loss"
            for name, grad in out["grads"].items():
                assert_close(f"grad {name} ({label}, rank {rank})", grad, want_grads[name])
                seen.add(name)
        assert seen == set(want_grads), f"{label}: gradients never checked: {set(want_grads) - seen}"
        if spec.tie_embeddings:  # every copy of the table took the same step, bit for bit
            copies = [o["params"]["embed"] for o in outputs if "embed" in o["params"]]
            assert len(copies) >= 2 and all(torch.equal(c, copies[0]) for c in copies)
            assert not torch.equal(copies[0], weights["embed"])


def test_exported_config_builds_the_same_transformers_model(tmp_path: Path) -> None:
    """to_hf_config's dict, loaded by transformers, gives the model the source config gave (same logits)."""
    from transformers import AutoConfig

    for family, keys in sorted(CONFIGS.items()):
        source, exported = tmp_path / f"{family}-in", tmp_path / f"{family}-out"
        source.mkdir()
        exported.mkdir()
        (source / "config.json").write_text(json.dumps({**SHAPE, **keys}))
        spec = from_hf_config(source / "config.json")
        (exported / "config.json").write_text(json.dumps(to_hf_config(spec)))
        loaded = AutoConfig.from_pretrained(exported)
        assert loaded.model_type == spec.family and loaded.head_dim == spec.head_dim
        assert loaded.tie_word_embeddings == spec.tie_embeddings
        assert loaded.rope_parameters["rope_theta"] == spec.rope_theta
        # what transformers itself writes (rope_parameters, layer_types, ...) reads back to the same spec
        resaved = tmp_path / f"{family}-resaved"
        loaded.save_pretrained(resaved)
        ignore = {"name", "max_position_embeddings"}
        assert from_hf_config(resaved / "config.json").model_dump(exclude=ignore) == spec.model_dump(exclude=ignore)
        weights = make_weights(spec, seed=3)
        tokens = torch.randint(0, spec.vocab_size, (1, SEQ + 1), generator=torch.Generator().manual_seed(6))
        a, _, _ = reference(source, spec, weights, tokens)
        b, _, _ = reference(exported, spec, weights, tokens)
        assert torch.equal(a, b), family


def test_tied_model_trains_like_one_device(tmp_path: Path, pool: WorkerPool) -> None:
    """Three AdamW steps (weight decay, clipping) of a tied model under an asymmetric plan equal
    single-process training (tests/test_parity.py's check, its tolerances): the embedding copies on the
    first and last stages stay one table. (Llama, not Qwen2: the k bias's gradient nearly cancels, since a
    bias on k shifts every score of a query alike but for the rotation, so Adam's normalised step on it
    flips sign with rounding, beyond that check's 0.1% allowance on a 32-element tensor.)"""
    keys = {**SHAPE, **CONFIGS["tied"], "num_hidden_layers": 4}
    spec = ModelSpec.model_validate({**from_hf_config(_write(tmp_path, keys)).model_dump(), "name": "tied-llama"})
    check_parity(make_plan(spec, [(1, 2, [(2, (0, 2)), (1, (2, 4))]), (2, 1, [(1, (0, 4))])]), tmp_path, pool)


def _write(folder: Path, config: dict[str, Any]) -> Path:
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "config.json"

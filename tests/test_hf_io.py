"""Hugging Face checkpoints in and out: names, per-rank sliced loading (multi-process gloo, TP and stages),
logit parity with transformers' LlamaForCausalLM, bit-identical round trips, peak host memory, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from flashflex_cli.cli import main as cli_main
from flashflex_cli.errors import InputError
from flashflex_cli.hf import names
from flashflex_cli.hf.files import HFCheckpoint
from flashflex_cli.hf.load import SlicedLoader, check_checkpoint
from flashflex_cli.hf.tiny import write_with_safetensors, write_with_transformers
from flashflex_cli.model.spec import PRESETS, ModelSpec
from flashflex_cli.plan.schema import Plan
from flashflex_cli.runtime.checkpoint.hf_export import export_hf, parse_size, plan_shards, read_hf_weights
from flashflex_cli.runtime.model.attention import SDPA
from flashflex_cli.runtime.model.stage import StageModule
from flashflex_cli.runtime.model.tensor_parallel import TPContext
from flashflex_cli.semantics.parameters import model_params
from flashflex_cli.semantics.run_folder import CHECKPOINT_SCHEMA
from tests.test_parity import make_plan

GOLDEN = Path(__file__).parent / "golden"
TINY = PRESETS["llama-tiny"]
GQA = PRESETS["llama-tiny-gqa"]
QWEN = ModelSpec(name="qwen-tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=176, vocab_size=256, family="qwen2", attention_bias=True, norm_eps=1e-6)
TIED = TINY.model_copy(update={"name": "tied-tiny", "tie_embeddings": True})
# fp32 logits of a 4-layer, hidden-64 model: both sides do the same fp32 matmuls in possibly different
# summation orders (<= 176 terms, relative error ~ sqrt(176) * 6e-8 ~ 1e-6), and flashflex builds its rotary
# tables in fp64 then rounds (transformers in fp32: ~1e-7 relative on cos/sin). Logits are ~0.1-1, so 1e-4
# absolute leaves 10-100x margin over what such rounding can accumulate through 4 layers.
LOGIT_ATOL = 1e-4


def flashflex_logits(spec: ModelSpec, loader: SlicedLoader, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, vocab] of the runtime's one-process model with weights from `loader` (TP 1)."""
    module = StageModule(spec, (0, spec.num_layers), True, True, TPContext(group=None), SDPA)
    with torch.no_grad():
        for info, param in module.global_parameters():
            param.copy_(loader(info, 1, 0))
        x = F.embedding(tokens, module.embed)
        cos, sin = module._tables(tokens.shape[1], tokens.device)
        for layer in module.layers:
            x = layer(x, cos, sin)
        return F.linear(module.norm(x), module.embed if spec.tie_embeddings else module.head)


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                              attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def test_names_map_both_ways() -> None:
    for info in model_params(GQA):
        hf = names.to_hf(info.name)
        assert names.from_hf(hf) == info.name
    assert names.to_hf("layers.3.attn.bq") == "model.layers.3.self_attn.q_proj.bias"
    assert names.from_hf("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    with pytest.raises(KeyError):
        names.to_hf("layers.0.attn.nope")


@pytest.mark.parametrize("spec", [TINY, GQA, QWEN, TIED], ids=["mha", "gqa", "qwen2-bias", "tied"])
def test_transformers_checkpoint_gives_the_same_logits(tmp_path: Path, spec: ModelSpec) -> None:
    """No rotary permutation is needed: the runtime's rotate-half layout is transformers' Llama layout."""
    pytest.importorskip("transformers")
    write_with_transformers(tmp_path, spec, seed=3)
    tokens = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = flashflex_logits(spec, SlicedLoader(tmp_path, spec), tokens)
    theirs = hf_logits(tmp_path, tokens)
    assert float(theirs.abs().max()) > 0.05  # a real signal, not all zeros
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOGIT_ATOL)


def test_tied_checkpoint_round_trip_in_one_process(tmp_path: Path) -> None:
    """A tied transformers checkpoint (no lm_head.weight) -> engine -> step-0 checkpoint -> export: the same
    tensors bit for bit, still without lm_head.weight, and transformers reads the same logits back."""
    pytest.importorskip("transformers")
    from flashflex_cli.runtime.checkpoint import dcp as ckpt
    from flashflex_cli.runtime.parallel.groups import build_groups
    from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine

    write_with_transformers(tmp_path / "hf", TIED, seed=2)
    source = read_hf_weights(tmp_path / "hf")
    assert names.HF_HEAD not in source
    plan = make_plan(TIED, [(1, 1, [(1, (0, TIED.num_layers))])], seq_len=8)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine = RankEngine(plan, 0, build_groups(plan, 0), torch.device("cpu"), OptimConfig(lr=1e-3),
                            initial=SlicedLoader(tmp_path / "hf", TIED))
        shards = ckpt.shards_for(engine.state_for_checkpoint(), engine.shard_specs(), 0)
        ckpt.save(tmp_path / "ckpt", 0, engine.state_for_checkpoint(), shards,
                  {"model": TIED.model_dump(mode="json"), "train": plan.inputs.train.model_dump(mode="json")})
    finally:
        dist.destroy_process_group()
    export_hf(tmp_path / "ckpt", tmp_path / "out", 10**9)
    exported = read_hf_weights(tmp_path / "out")
    assert exported.keys() == source.keys()
    assert all(torch.equal(exported[k], v) for k, v in source.items())
    tokens = torch.randint(0, TIED.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hf_logits(tmp_path / "out", tokens), hf_logits(tmp_path / "hf", tokens), rtol=0, atol=0)


def test_sliced_reads_equal_slices_of_full_tensors(tmp_path: Path) -> None:
    write_with_safetensors(tmp_path, GQA, seed=1, dtype=torch.bfloat16)
    loader = SlicedLoader(tmp_path, GQA)
    full = {k: v.float() for k, v in read_hf_weights(tmp_path).items()}
    for info in model_params(GQA):
        for tp in (1, 2):
            for rank in range(tp):
                got = loader(info, tp, rank)
                assert got.dtype == torch.float32 and tuple(got.shape) == info.local_shape(tp, rank)
                assert torch.equal(got, info.take(full[names.to_hf(info.name)], tp, rank)), info.name


def _rank_main(rank: int, world: int, plan_json: str, hf_dir: str, ckpt_dir: str, store: str,
               errors: str) -> None:
    """One rank: engine initialised from the HF folder, a step-0 checkpoint, then one training step's loss."""
    try:
        from flashflex_cli.runtime.checkpoint import dcp as ckpt
        from flashflex_cli.runtime.parallel.groups import build_groups
        from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        plan = Plan.model_validate_json(plan_json)
        spec = plan.inputs.model
        engine = RankEngine(plan, rank, build_groups(plan, rank), torch.device("cpu"), OptimConfig(lr=1e-3),
                            seed=99, initial=SlicedLoader(hf_dir, spec))
        shards = ckpt.shards_for(engine.state_for_checkpoint(), engine.shard_specs(), rank)
        manifest = {"model": spec.model_dump(mode="json"), "train": plan.inputs.train.model_dump(mode="json"),
                    "init_from": hf_dir}
        ckpt.save(ckpt_dir, 0, engine.state_for_checkpoint(), shards, manifest)
        batch = torch.load(Path(ckpt_dir).parent / "batch.pt")
        result = engine.train_step(batch[engine.pipeline_slice(batch.shape[0])])
        if rank == 0:
            (Path(ckpt_dir).parent / "loss.txt").write_text(repr(result.loss))
        dist.destroy_process_group()
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise


def _run_ranks(plan: Plan, hf_dir: Path, ckpt_dir: Path) -> None:
    errors = ckpt_dir.parent / "errors"
    errors.mkdir()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, plan.world_size, plan.to_json(), str(hf_dir), str(ckpt_dir),
                                                  str(ckpt_dir.parent / "store"), str(errors)))
             for r in range(plan.world_size)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)
    for proc in procs:
        if proc.is_alive():  # a hung collective: end this test's own processes
            proc.kill()
            proc.join()
    problems = [p.read_text() for p in sorted(errors.iterdir())]
    assert not problems and all(p.exitcode == 0 for p in procs), "\n".join(problems)


def test_init_from_any_plan_then_export_round_trip(tmp_path: Path) -> None:
    """HF (bf16) -> 4 ranks (2 stages, TP 2 then TP 1 + a second pipeline) -> step-0 checkpoint -> export:
    bf16 export bit-identical to the source, fp32 export its exact upcast; the first step's loss equals
    transformers' on the same batch; the sharded fp32 export loads in transformers with the same logits."""
    hf_dir, ckpt_dir = tmp_path / "hf", tmp_path / "ckpt"
    write_with_safetensors(hf_dir, GQA, seed=5, dtype=torch.bfloat16)
    (hf_dir / "tokenizer.json").write_text("{}\n")
    plan = make_plan(GQA, [(1, 2, [(2, (0, 1)), (1, (1, 4))]), (2, 1, [(1, (0, 4))])], seq_len=16)
    batch = torch.randint(0, GQA.vocab_size, (plan.inputs.train.global_batch, 17),
                          generator=torch.Generator().manual_seed(7))
    torch.save(batch, tmp_path / "batch.pt")
    _run_ranks(plan, hf_dir, ckpt_dir)

    source = read_hf_weights(hf_dir)
    bf16 = export_hf(ckpt_dir, tmp_path / "out-bf16", parse_size("1GB"), dtype="bf16")
    assert bf16.files == ("model.safetensors",) and bf16.copied == ("tokenizer.json",)
    exported = read_hf_weights(tmp_path / "out-bf16")
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        assert exported[name].dtype == torch.bfloat16
        assert torch.equal(exported[name].view(torch.int16), tensor.view(torch.int16)), name  # bit-identical
    small = export_hf(ckpt_dir, tmp_path / "out-fp32", parse_size("40KB"), dtype="fp32")
    assert len(small.files) > 1 and (tmp_path / "out-fp32" / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "out-fp32" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source) and set(index["weight_map"].values()) == set(small.files)
    for name, tensor in read_hf_weights(tmp_path / "out-fp32").items():
        assert torch.equal(tensor, source[name].float()), name

    transformers = pytest.importorskip("transformers")
    tokens = batch[:, :-1]
    ours = flashflex_logits(GQA, SlicedLoader(hf_dir, GQA), tokens)
    theirs = hf_logits(tmp_path / "out-fp32", tokens)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=LOGIT_ATOL)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out-fp32"), dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens).logits
    want = F.cross_entropy(logits.reshape(-1, GQA.vocab_size), batch[:, 1:].reshape(-1)).item()
    # the mean of 4 x 16 per-token fp32 cross-entropies (~5.5 each), summed in another order: ~1e-6 relative
    assert float((tmp_path / "loss.txt").read_text()) == pytest.approx(want, rel=1e-5)


def test_export_refuses_bad_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ckpt").mkdir()
    cases = [
        (["export", str(tmp_path / "nothing"), "--hf", str(tmp_path / "o")], "no such checkpoint or run folder"),
        (["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "o")], "no complete flashflex checkpoint"),
        (["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "o"), "--max-shard-size", "lots"],
         "--max-shard-size"),
    ]
    for argv, text in cases:
        assert cli_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error:") and text in err, err
    assert not (tmp_path / "o").exists()
    assert plan_shards(["a", "b", "c"], {"a": 5, "b": 5, "c": 20}, 10) == [["a", "b"], ["c"]]


def test_export_refuses_its_input_and_a_full_folder(tmp_path: Path) -> None:
    from flashflex_cli.runtime.checkpoint import dcp as ckpt

    step = tmp_path / "ckpt" / "step-000000"
    step.mkdir(parents=True)
    (step / ckpt.MANIFEST).write_text(json.dumps({"schema": CHECKPOINT_SCHEMA, "step": 0, "tensors": {},
                                                   "model": TINY.model_dump(mode="json")}))
    for out in (tmp_path / "ckpt", step, step / "hf"):
        with pytest.raises(InputError, match="overlaps the checkpoint"):
            export_hf(tmp_path / "ckpt", out, 10**9)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(InputError, match="not empty"):
        export_hf(tmp_path / "ckpt", tmp_path / "full", 10**9)
    with pytest.raises(InputError, match="missing from the checkpoint"):  # an empty manifest
        export_hf(tmp_path / "ckpt", tmp_path / "new", 10**9)
    assert (tmp_path / "full" / "x").read_text() == "keep" and not (tmp_path / "new").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def _launch(tmp_path: Path, hf_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli_main(["launch", str(GOLDEN / "plan-1rank.json"), "--cluster", str(GOLDEN / "cluster-2node.json"),
                     "--steps", "1", "--out", str(tmp_path / "run"), "--init-from", str(hf_dir)])
    return code, capsys.readouterr().err.strip()


def test_launch_init_from_bad_checkpoints_exit_2_before_starting(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file

    good = tmp_path / "good"
    write_with_safetensors(good, TINY, seed=0)
    check_checkpoint(good, TINY)
    weights = read_hf_weights(good)

    def variant(name: str, config: dict | None = None, tensors: dict | None = None, raw: bytes | None = None) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        cfg = json.loads((good / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **(config or {})}))
        if raw is not None:
            (folder / "model.safetensors").write_bytes(raw)
        elif tensors is not None:
            save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    head = names.to_hf("head")
    wq = names.to_hf("layers.0.attn.wq")
    cases = [
        (variant("wider", config={"hidden_size": 128, "head_dim": 32}), "hidden_size is 128"),
        (variant("deeper", config={"num_hidden_layers": 5}), "num_layers is 5"),
        (variant("no-weights"), "no model.safetensors"),
        (variant("corrupt", raw=b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"), "not a readable safetensors"),
        (variant("truncated", raw=(good / "model.safetensors").read_bytes()[:5000]), "not a readable safetensors"),
        (variant("missing", tensors={k: v for k, v in weights.items() if k != head}), f"{head} is missing"),
        (variant("shape", tensors={**weights, wq: weights[wq][:32]}), f"{wq} has shape [32, 64]"),
        (variant("ints", tensors={**weights, wq: weights[wq].to(torch.int32)}), "has dtype I32"),
        (tmp_path / "absent", "no such folder"),
    ]
    for folder, text in cases:
        code, err = _launch(tmp_path, folder, capsys)
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error:") and text in err, (folder, err)
        assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


def test_sharded_checkpoint_index_problems(tmp_path: Path) -> None:
    write_with_safetensors(tmp_path / "one", TINY, seed=0)
    weights = read_hf_weights(tmp_path / "one")
    folder = tmp_path / "sharded"
    export_like = {"a.safetensors": dict(list(weights.items())[:10]), "b.safetensors": dict(list(weights.items())[10:])}
    from safetensors.torch import save_file

    folder.mkdir()
    for file, tensors in export_like.items():
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    (folder / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    weight_map = {name: file for file, tensors in export_like.items() for name in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert len(check_checkpoint(folder, TINY).entries) == len(weights)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map, "x": "../a"}}))
    with pytest.raises(InputError, match="must be a file name"):
        HFCheckpoint(folder)
    (folder / "b.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(InputError, match="b.safetensors: no such file"):
        HFCheckpoint(folder)


PEAK_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from flashflex_cli.hf.load import SlicedLoader
from flashflex_cli.model.spec import ModelSpec
from flashflex_cli.semantics.parameters import stage_params

folder, spec_json, first, stop, tp, tp_rank = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
spec = ModelSpec.model_validate_json(spec_json)

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
loader = SlicedLoader(folder, spec)
infos = stage_params(spec, (first, stop), first == 0, stop == spec.num_layers)
warm = loader(infos[-1], tp, tp_rank)  # one-time costs of the first read (library set-up) are not the share
del warm
Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
held = [loader(info, tp, tp_rank) for info in infos]
share = sum(t.numel() * t.element_size() for t in held)
print(json.dumps({"growth": status("VmHWM") - before, "share": share, "rss_before": before}))
"""


def test_peak_host_memory_stays_near_the_ranks_share(tmp_path: Path) -> None:
    """A rank holding half of 4 of 16 layers (TP 2) of a ~60 MB checkpoint grows its peak RSS by at most
    twice its ~6 MB share while loading (a column slice maps the whole tensor's pages, one tensor at a time)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    spec = ModelSpec(name="peak", hidden_size=256, num_layers=16, num_heads=8, num_kv_heads=4,
                     intermediate_size=688, vocab_size=4096)
    write_with_safetensors(tmp_path, spec, seed=0)
    total = (tmp_path / "model.safetensors").stat().st_size
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path), spec.model_dump_json(), "4", "8",
                           "2", "1"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    print(f"checkpoint {total / 2**20:.1f} MiB, rank share {found['share'] / 2**20:.2f} MiB, "
          f"peak RSS growth {found['growth'] / 2**20:.2f} MiB")
    assert total > 8 * found["share"]
    assert found["growth"] <= 2 * found["share"]

"""`flashflex profile --model`: real measurements of llama-tiny on CPU (spawned gloo ranks for tp 2), activation
bytes against hand counts, and bad input refused with exit 2 and nothing written.

No assertion compares two timings (the host is shared and noisy): only structure and physical facts.
"""

from __future__ import annotations

import json

import pytest
import torch

from flashflex_cli.cli import main
from flashflex_cli.commands.profile import parse_int_list
from flashflex_cli.errors import InputError
from flashflex_cli.layers.schema import LayerProfile, load_layer_profile
from flashflex_cli.model.flops import layer_matmul_params
from flashflex_cli.model.hf_config import resolve_model
from flashflex_cli.profiler.layer_bench import BenchConfig, devices_available, measure
from flashflex_cli.runtime.model.attention import EAGER, SDPA, attention_fn

SEQ = 32
TINY = resolve_model("llama-tiny")  # hidden 64, 4 heads of 16 (no GQA), MLP 176, vocab 256
FP32 = 4  # bytes
FAST = ["--repeats", "2", "--warmup", "1"]

cpu_only = pytest.mark.skipif(devices_available()[0] != "cpu", reason="hand counts are for the CPU fp32 path")


def eager_layer_bytes(b: int, s: int, tp: int = 1) -> int:
    """Hand count of what one llama-tiny layer keeps for its backward with eager attention, fp32, in bytes.

    Per token (floats), leaving out the layer input (it exists before the forward) and the weights:
      2 RMSNorms: 1/rsqrt + h (x * rsqrt, saved by "* weight") + h (normed output, saved by the linears)
      q, k, v after rotary: 3 * heads/tp * hd (q, k and v before rotary are not saved: cos/sin need no grad)
      attention output (input of wo): heads/tp * hd
      softmax probabilities: heads/tp * s (the s x s matrix per head, the point of the eager backend)
      residual h = x + attn (input of the MLP norm): h
      SwiGLU: gate, silu(gate), up, silu * up: 4 * ffn/tp
      the layer output: h
    """
    h, hd, heads, ffn = TINY.hidden_size, TINY.head_dim, TINY.num_heads // tp, TINY.intermediate_size // tp
    per_token = 2 * (1 + 2 * h) + 4 * heads * hd + heads * s + h + 4 * ffn + h
    return FP32 * b * s * per_token


@pytest.fixture(scope="module")
def sdpa_profile(tmp_path_factory) -> LayerProfile:
    """One real measurement through the CLI: llama-tiny, seq 32, micro-batches 1 and 2, tp 1 and 2."""
    kind, count = devices_available()
    if kind != "cpu" or count < 2:
        pytest.skip("needs a CPU-only host with two usable cores (tp 2)")
    out = tmp_path_factory.mktemp("layers") / "tiny.json"
    code = main(["profile", "--model", "llama-tiny", "--seq-len", str(SEQ), "--micro-batch", "1,2", "--tp", "1,2",
                 "--attention", "sdpa", *FAST, "--out", str(out)])
    assert code == 0
    return load_layer_profile(out)


def _entry(profile: LayerProfile, b: int, tp: int):  # noqa: ANN202 - a ProfileEntry
    return next(e for e in profile.entries if (e.micro_batch_size, e.tp) == (b, tp))


def test_cli_writes_a_valid_layer_profile(sdpa_profile):
    p = sdpa_profile
    assert p.device_type == "cpu" and p.dtype == "fp32" and p.attention == "sdpa" and p.recompute is False
    assert p.seq_len == SEQ and p.model.hidden_size == 64 and p.model.vocab_size == 256
    assert p.source.startswith("flashflex profile --model, torch ")
    assert sorted((e.micro_batch_size, e.tp) for e in p.entries) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for entry in p.entries:
        assert entry.fixed_bytes is None  # not measured on CPU
        for part in (entry.layer, entry.embedding, entry.head):
            assert part.fwd_s > 0 and part.bwd_s > 0 and part.activation_bytes > 0


def test_activation_bytes_grow_with_the_micro_batch(sdpa_profile):
    for tp in (1, 2):
        one, two = _entry(sdpa_profile, 1, tp), _entry(sdpa_profile, 2, tp)
        for name in ("layer", "embedding", "head"):
            assert getattr(two, name).activation_bytes > getattr(one, name).activation_bytes
        # everything a layer keeps scales with the sequences of the micro-batch: exactly twice
        assert two.layer.activation_bytes == 2 * one.layer.activation_bytes


def test_tp_shards_what_a_layer_keeps(sdpa_profile):
    """At tp 2 each rank keeps half the sharded activations (q, k, v, attention output, MLP) and all of the
    replicated ones (norms, residual, output), so strictly less than at tp 1 and more than half of it."""
    for b in (1, 2):
        whole, shard = _entry(sdpa_profile, b, 1).layer, _entry(sdpa_profile, b, 2).layer
        assert whole.activation_bytes / 2 < shard.activation_bytes < whole.activation_bytes


def test_embedding_keeps_its_output(sdpa_profile):
    """tp 1: the embedding saves only the token ids (existing before the forward): it keeps its output."""
    for b in (1, 2):
        assert _entry(sdpa_profile, b, 1).embedding.activation_bytes == FP32 * b * SEQ * TINY.hidden_size


@cpu_only
def test_eager_matches_the_hand_count_and_keeps_more_than_sdpa(sdpa_profile):
    config = BenchConfig(TINY, SEQ, (1, 2), attention="eager", repeats=1, warmup=1)
    entries, skipped = measure(config, (1,), "cpu")
    assert not skipped and len(entries) == 2
    for entry in entries:
        b = entry.micro_batch_size
        measured = entry.parts["layer"].activation_bytes
        # Tolerance: less than one [b, s, hidden] fp32 tensor, so a torch version saving a view instead of a
        # copy (or one such tensor more) passes, while the s x s probabilities (2x that size here) must be there.
        assert abs(measured - eager_layer_bytes(b, SEQ)) < FP32 * b * SEQ * TINY.hidden_size
        sdpa = _entry(sdpa_profile, b, 1).layer.activation_bytes
        probs = FP32 * b * TINY.num_heads * SEQ * SEQ
        lse = FP32 * b * TINY.num_heads * SEQ  # the one thing SDPA may keep that eager does not
        assert measured - sdpa >= probs - lse > 0


@cpu_only
def test_recompute_keeps_only_the_layer_output():
    config = BenchConfig(TINY, SEQ, (1,), recompute=True, repeats=1, warmup=1)
    entries, skipped = measure(config, (1,), "cpu")
    assert not skipped
    layer = entries[0].parts["layer"]
    assert layer.activation_bytes == FP32 * SEQ * TINY.hidden_size and layer.bwd_s > 0


def test_eager_backend_equals_sdpa_numerically():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 4, 8, generator=gen)
    k, v = torch.randn(2, 9, 2, 8, generator=gen), torch.randn(2, 9, 2, 8, generator=gen)  # GQA: 2 kv heads
    torch.testing.assert_close(attention_fn(EAGER)(q, k, v), attention_fn(SDPA)(q, k, v), rtol=1e-5, atol=1e-5)


def test_parse_int_list():
    assert parse_int_list("1,2, 4", "--tp") == (1, 2, 4)
    for bad in ("1,,2", "", "0", "-1", "1.5", "a", "2,2"):
        with pytest.raises(InputError):
            parse_int_list(bad, "--micro-batch")


def _hf_config(path, heads: int) -> str:
    config = {"hidden_size": 2 * heads, "num_hidden_layers": 1, "num_attention_heads": heads,
              "intermediate_size": 4 * heads, "vocab_size": 256}
    path.write_text(json.dumps(config))
    return str(path)


BAD = [
    (["--model", "no-such-model", "--seq-len", "8"], "unknown model"),
    (["--model", "llama-tiny"], "--seq-len"),
    (["--model", "llama-tiny", "--seq-len", "0"], "--seq-len"),
    (["--model", "llama-tiny", "--seq-len", "8", "--repeats", "0"], "--repeats"),
    (["--model", "llama-tiny", "--seq-len", "8", "--micro-batch", "1,,2"], "--micro-batch"),
    (["--model", "llama-tiny", "--seq-len", "8", "--micro-batch", "0"], "--micro-batch"),
    (["--model", "llama-tiny", "--seq-len", "8", "--tp", "3"], "does not divide"),
    (["--model", "llama-tiny", "--seq-len", "8", "--tp", "1,x"], "--tp"),
    (["--model", "llama-tiny", "--seq-len", "8", "--dtype", "fp64"], "--dtype"),
    (["--model", "llama-tiny", "--seq-len", "8", "--attention", "paged"], "--attention"),
    (["--model", "llama-tiny", "--seq-len", "8", "--synthetic", "1x1xcpu"], "--synthetic"),
    (["--model", "llama-tiny", "--seq-len", "8", "--distributed"], "--distributed"),
]


@pytest.mark.parametrize(("args", "needle"), BAD)
def test_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "out.json"
    assert main(["profile", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_tp_beyond_the_devices_is_refused(tmp_path, capsys):
    model = _hf_config(tmp_path / "wide.json", heads=1024)  # tp 1024 divides its heads
    out = tmp_path / "out.json"
    assert main(["profile", "--model", model, "--seq-len", "8", "--tp", "1024", "--out", str(out)]) == 2
    assert "needs 1024 devices" in capsys.readouterr().err and not out.exists()


def test_out_that_is_a_folder_or_the_input_is_refused(tmp_path, capsys):
    model = _hf_config(tmp_path / "config.json", heads=4)
    before = (tmp_path / "config.json").read_text()
    assert main(["profile", "--model", model, "--seq-len", "8", "--out", str(tmp_path)]) == 2
    assert main(["profile", "--model", model, "--seq-len", "8", "--out", model]) == 2
    err = capsys.readouterr().err
    assert "is a folder" in err and "is also an input" in err
    assert (tmp_path / "config.json").read_text() == before and sorted(tmp_path.iterdir()) == [tmp_path / "config.json"]


@pytest.mark.skipif(devices_available()[0] != "cpu", reason="tf32 is refused on CPU only")
def test_tf32_on_cpu_is_refused(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["profile", "--model", "llama-tiny", "--seq-len", "8", "--dtype", "tf32", "--out", str(out)]) == 2
    assert "needs a GPU" in capsys.readouterr().err and not out.exists()


def test_half_precision_profiles_on_cpu_under_autocast(tmp_path):
    """bf16 and fp16 run under CPU autocast as on a GPU: their layer keeps the 16-bit copies of its matmul weights
    that autocast made for the backward (the fp32 layer saves its weights themselves, which were there before)."""
    sizes = {}
    for dtype in ("fp32", "bf16", "fp16"):
        out = tmp_path / f"{dtype}.json"
        assert main(["profile", "--model", "llama-tiny", "--seq-len", "16", "--micro-batch", "2", "--dtype", dtype,
                     "--repeats", "1", "--warmup", "0", "--out", str(out)]) == 0
        profile = load_layer_profile(out)
        assert profile.dtype == dtype
        sizes[dtype] = profile.entries[0].layer.activation_bytes
    weight_copies = 2 * layer_matmul_params(resolve_model("llama-tiny"))
    assert sizes["fp32"] > 0 and sizes["bf16"] > weight_copies and sizes["fp16"] == sizes["bf16"]


def test_without_model_the_layer_options_are_refused(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["profile", "--synthetic", "1x1xcpu", "--seq-len", "8", "--out", str(out)]) == 2
    assert "--model" in capsys.readouterr().err and not out.exists()



def test_compile_needs_model_and_reaches_the_bench_config(tmp_path, capsys):
    from flashflex_cli.commands.profile import LayerRequest, layer_config

    out = tmp_path / "c.json"
    assert main(["profile", "--synthetic", "1x1xcpu", "--compile", "--out", str(out)]) == 2
    assert "--compile" in capsys.readouterr().err and not out.exists()
    for flag in (True, False, None):
        request = LayerRequest("llama-tiny", 8, "1", "1", None, "sdpa", False, 1, 0, flag)
        config = layer_config(request, "cpu")
        assert config.runtime.compile is flag and config.runtime.chunked_loss
        assert config.runtime.resolved(False).compile is (flag is True)
        assert config.runtime.resolved(True).compile is (flag is not False)


def test_the_profile_runs_and_records_the_runtimes_paths():
    """The parts run on the run's paths and the profile says which: bf16 with the weights cast once (the layer then
    keeps no per-micro-batch 16-bit copies of its matrices: the copies are made before the forward, as a run makes
    them once per step) and torch's fused loss; the paths issue 31 added recorded beside compile and the loss."""
    from flashflex_cli.profiler.layer_bench import build_profile
    from flashflex_cli.semantics.runtime_paths import RuntimeOptions

    spec = resolve_model("llama-tiny")
    layer_bytes = {}
    for cast_once in (False, True):
        config = BenchConfig(spec=spec, seq_len=16, micro_batches=(2,), dtype="bf16", repeats=1, warmup=0,
                             runtime=RuntimeOptions(compile=False, cast_once=cast_once, loss_kernel="torch"))
        entries, skipped = measure(config, (1,), "cpu")
        assert not skipped
        profile = build_profile(config, entries, "cpu", "test")
        paths = profile.paths()
        assert (paths.cast_once, paths.loss_kernel, paths.compile, paths.compile_scope) == \
            (cast_once, "torch", False, None)
        layer_bytes[cast_once] = entries[0].parts["layer"].activation_bytes
    copies = 2 * layer_matmul_params(spec)
    assert layer_bytes[False] - layer_bytes[True] == pytest.approx(copies, rel=0.01)

"""Hostile input across every subcommand: one line on stderr, exit 2 (1 for a failed check the user asked
for), no traceback, no process started, and no output or temporary file left or changed."""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.data import token_file as token_data
from flashflex_cli.errors import InputError
from flashflex_cli.fileio import check_writable_dir, check_writable_output
from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
LONG = "n" * 300
PLAN = ["{d}/plan.json", "-c", "{d}/cluster.json"]
LAUNCH = ["launch", *PLAN]
RENDER = [*LAUNCH, "--launcher", "torchrun"]
PLAN_CMD = ["plan", "{d}/cluster.json", "-m", "llama-tiny", "-b", "8", "-s", "32", "--strategy", "uniform",
            "--no-baseline"]
SYNTH = ["profile", "--synthetic"]
HUGE = 10**400  # an integer no float holds
DEVICE = ("nodes", 0, "devices", 0)
# Cluster files with one physically impossible (or mistyped) number: name -> (field path, value)
BAD_CLUSTERS: dict[str, tuple[tuple[object, ...], object]] = {
    "memory-1e40": (DEVICE + ("memory_bytes",), 10**40),
    "memory-float-1e40": (DEVICE + ("memory_bytes",), 1e40),
    "memory-string": (DEVICE + ("memory_bytes",), "4294967296"),
    "memory-bool": (DEVICE + ("memory_bytes",), True),
    "memory-negative-zero": (DEVICE + ("memory_bytes",), -0.0),
    "membw-tiny": (DEVICE + ("memory_bandwidth",), 1e-300),
    "flops-1e40": (DEVICE + ("peak_flops", "fp32"), 1e40),
    "achieved-huge-int": (DEVICE + ("achieved_flops",), {"fp32": HUGE}),
    "slowdown-1e308": (DEVICE + ("slowdown",), 1e308),
    "slowdown-below-1": (DEVICE + ("slowdown",), 0.5),
    "nic-bw-tiny": (("nodes", 0, "nic_bandwidth"), 1e-300),
    "intra-bw-tiny": (("nodes", 0, "intra_link"), {"kind": "shm", "bandwidth": 1e-300}),
    "intra-latency-negative-zero": (("nodes", 0, "intra_link"), {"kind": "shm", "latency_s": -0.0}),
    "intra-pair-bw-tiny": (("nodes", 0, "intra_pairs"), [{"a": 0, "b": 1, "bandwidth": 1e-300}]),
    "intra-pair-index-string": (("nodes", 0, "intra_pairs"), [{"a": "0", "b": 1, "bandwidth": 1e9}]),
    "pair-bw-tiny": (("inter_node",), {"pairs": [{"a": "node0", "b": "node1", "bandwidth": 1e-300}]}),
    "pair-latency-hours": (("inter_node",), {"pairs": [{"a": "node0", "b": "node1", "bandwidth": 1e9,
                                                       "latency_s": 3600.0}]}),
    "default-bw-huge": (("inter_node",), {"default_bandwidth": 1e300}),
    "default-latency-tiny": (("inter_node",), {"latency_s": 1e-300}),
    "hostname-shell": (("nodes", 0, "hostname"), "a;rm -rf x"),
}
# Layer profiles (flashflex.layers/1) with one impossible number
LAYER_PART = {"fwd_s": 1e-3, "bwd_s": 2e-3, "activation_bytes": 1e6}
LAYERS = {"schema": "flashflex.layers/1", "device_type": "cpu",
          "model": {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 176, "vocab_size": 256},
          "seq_len": 32, "dtype": "bf16", "attention": "sdpa",
          "entries": [{"micro_batch_size": 1, "tp": 1, "layer": LAYER_PART, "embedding": LAYER_PART,
                       "head": LAYER_PART, "fixed_bytes": 1e8}]}
ENTRY = ("entries", 0)
BAD_LAYERS: dict[str, tuple[tuple[object, ...], object]] = {
    "fwd-1e300": (ENTRY + ("layer", "fwd_s"), 1e300),
    "fwd-string": (ENTRY + ("layer", "fwd_s"), "0.1"),
    "bwd-bool": (ENTRY + ("head", "bwd_s"), True),
    "activation-1e40": (ENTRY + ("layer", "activation_bytes"), 1e40),
    "fixed-huge-int": (ENTRY + ("fixed_bytes",), HUGE),
    "mbs-huge-int": (ENTRY + ("micro_batch_size",), HUGE),
    "tp-billion": (ENTRY + ("tp",), 10**9),
    "hidden-huge-int": (("model", "hidden_size"), HUGE),
}
# Cost-parameter files (JSON text)
BAD_COST_PARAMS = {
    "truncated": '{"tp_comm_efficiency": 0.',
    "efficiency-tiny": '{"tp_comm_efficiency": 1e-300}',
    "reserve-huge-int": '{"memory_reserve_bytes": 1' + "0" * 400 + "}",
    "digits-5000": '{"memory_reserve_bytes": ' + "1" * 5000 + "}",
    "passes-string": '{"loss_passes": "2"}',
    "bytes-negative-zero": '{"memory_reserve_bytes": -0.0, "grad_reduce_bytes": 1e300}',
}
BAD_PRICES = {"tiny": 1e-300, "string": "1", "bool": True, "huge-int": HUGE}


def _mutated(data: dict, path: tuple[object, ...], value: object) -> dict:
    """A deep copy of `data` with the field at `path` set to `value`."""
    out = copy.deepcopy(data)
    node: object = out
    for key in path[:-1]:
        node = node[key]  # type: ignore[index]
    node[path[-1]] = value  # type: ignore[index]
    return out


def _plan_on(cluster: str, *extra: str) -> list[str]:
    """`flashflex plan` of llama-tiny on `cluster` with an output file."""
    return ["plan", cluster, "-m", "llama-tiny", "-b", "8", "-s", "32", "--strategy", "uniform", "--no-baseline",
            "--out", "{d}/never.json", *extra]


def _plan_with_predicted(predicted: object) -> dict:
    plan = json.loads((GOLDEN / "plan-4rank.json").read_text())
    if predicted is None:
        plan.pop("predicted", None)
    else:
        plan["predicted"] = predicted
    return plan


def _predicted(**changes: object) -> dict:
    base = {"iteration_time_s": 1.0, "tokens_per_s": 256.0, "mfu": 0.1, "fits": True,
            "stages": [{"pipeline": 0, "stage": 0, "time_s": 0.5, "source": "modelled"}], "problems": []}
    return {**base, **changes}


def _bad_vocab_tokens(path: Path) -> None:
    """A token file whose header claims vocab 256 (llama-tiny's) but holds id 300."""
    ids = [1, 2, 3] * 200 + [300]
    header = token_data._HEADER.pack(token_data.MAGIC, token_data.VERSION, 2, 256, len(ids))
    path.write_bytes(header.ljust(token_data.HEADER_BYTES, b"\0") + struct.pack(f"<{len(ids)}H", *ids))


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """Inputs every case may name: a cluster, plans, a text file, token files, a tokenizer stand-in."""
    shutil.copy(GOLDEN / "cluster-2node.json", tmp_path / "cluster.json")
    shutil.copy(GOLDEN / "plan-4rank.json", tmp_path / "plan.json")
    (tmp_path / "text.txt").write_text("hello hostile world\n" * 50)
    (tmp_path / "tok.json").write_text("{}")
    (tmp_path / "bin.tmpl").write_bytes(b"\xff\xfe\x00 not a template")
    token_data.write_token_file(tmp_path / "tokens.bin", [1, 2, 3] * 100, 256)
    _bad_vocab_tokens(tmp_path / "badvocab.bin")
    for name, predicted in {"a.json": _predicted(), "nan.json": _predicted(tokens_per_s=math.nan),
                            "none.json": None, "str.json": _predicted(tokens_per_s="fast"),
                            "missing.json": {"fits": True},
                            "stage.json": _predicted(stages=[{"pipeline": "0", "stage": 0}]),
                            "problems.json": _predicted(problems="boom"),
                            "inf.json": _predicted(iteration_time_s=math.inf),
                            "negative.json": _predicted(tokens_per_s=-1.0),
                            "huge.json": _predicted(mfu=HUGE),
                            "stage-nan.json": _predicted(stages=[{"pipeline": 0, "stage": 0, "time_s": math.nan}]),
                            "stage-negative.json": _predicted(stages=[{"pipeline": 0, "stage": 0,
                                                                       "time_s": -0.5}])}.items():
        (tmp_path / name).write_text(json.dumps(_plan_with_predicted(predicted)))
    plan = json.loads((GOLDEN / "plan-4rank.json").read_text())
    for name, (path, value) in {"batch-huge": (("inputs", "train", "global_batch"), HUGE),
                                "seq-string": (("inputs", "train", "seq_len"), "32"),
                                "hidden-huge": (("inputs", "model", "hidden_size"), 2**40),
                                "eps-huge": (("inputs", "model", "norm_eps"), 1e300),
                                "seed-huge": (("inputs", "seed"), HUGE)}.items():
        (tmp_path / f"plan-{name}.json").write_text(json.dumps(_mutated(plan, path, value)))
    cluster = json.loads((GOLDEN / "cluster-2node.json").read_text())
    for name, (path, value) in BAD_CLUSTERS.items():
        (tmp_path / f"cluster-{name}.json").write_text(json.dumps(_mutated(cluster, path, value)))
    for name, (path, value) in BAD_LAYERS.items():
        (tmp_path / f"layers-{name}.json").write_text(json.dumps(_mutated(LAYERS, path, value)))
    for name, text in BAD_COST_PARAMS.items():
        (tmp_path / f"cost-{name}.json").write_text(text)
    for name, price in BAD_PRICES.items():
        (tmp_path / f"prices-{name}.json").write_text(json.dumps(
            {"schema": "flashflex.prices/1", "prices": [{"type": "cpu", "per_device_hour": price}]}))
    return tmp_path


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (hidden ones too) with the bytes of each file."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Record any attempt to start the local workers (none may happen)."""
    calls: list[object] = []
    monkeypatch.setattr("flashflex_cli.launch.local.launch_local", lambda *args, **kw: calls.append(args))
    yield calls


CASES: list[tuple[str, list[str], int]] = [
    # output paths: a folder, empty, under a file, a name too long, not writable, not a regular file
    ("profile-out-dir", [*SYNTH, "1x4xcpu", "--out", "{d}"], 2),
    ("profile-out-empty", [*SYNTH, "1x4xcpu", "--out", ""], 2),
    ("profile-out-under-file", [*SYNTH, "1x4xcpu", "--out", "{d}/text.txt/c.json"], 2),
    ("profile-out-long", [*SYNTH, "1x4xcpu", "--out", "{d}/" + LONG + ".json"], 2),
    ("profile-out-proc", [*SYNTH, "1x4xcpu", "--out", "/proc/flashflex-test/c.json"], 2),
    ("profile-out-devnull", [*SYNTH, "1x4xcpu", "--out", "/dev/null"], 2),
    ("profile-out-missing", ["profile", "--synthetic", "1x4xcpu"], 2),
    # synthetic specs: non-finite numbers, absurd sizes
    ("spec-slowdown-inf", [*SYNTH, "1x4xcpu:slowdown=1e309", "--out", "{d}/c.json"], 2),
    ("spec-bw-inf", [*SYNTH, "1x4xcpu:bw=1e400", "--out", "{d}/c.json"], 2),
    ("spec-slowdown-nan", [*SYNTH, "1x4xcpu:slowdown=nan", "--out", "{d}/c.json"], 2),
    ("spec-billion-nodes", [*SYNTH, "1000000000x8xA100", "--out", "{d}/c.json"], 2),
    ("spec-huge-digits", [*SYNTH, "9" * 5000 + "x1xcpu", "--out", "{d}/c.json"], 2),
    ("spec-devices-per-node", [*SYNTH, "1x4096xcpu", "--out", "{d}/c.json"], 2),
    ("spec-total-devices", [*SYNTH, "1000x1000xcpu", "--out", "{d}/c.json"], 2),
    ("spec-zero-nodes", [*SYNTH, "0x4xcpu", "--out", "{d}/c.json"], 2),
    ("profile-cpu-devices", ["profile", "--cpu-devices", "100000", "--out", "{d}/c.json"], 2),
    # profile merge
    ("merge-out-is-input", ["profile", "merge", "{d}/cluster.json", "--out", "{d}/cluster.json"], 2),
    ("merge-out-dir", ["profile", "merge", "{d}/cluster.json", "--out", "{d}"], 2),
    ("merge-out-under-file", ["profile", "merge", "{d}/cluster.json", "--out", "{d}/text.txt/m.json"], 2),
    ("merge-out-long", ["profile", "merge", "{d}/cluster.json", "--out", "{d}/" + LONG], 2),
    # plan --out
    ("plan-out-dir", [*PLAN_CMD, "--out", "{d}"], 2),
    ("plan-out-empty", [*PLAN_CMD, "--out", ""], 2),
    ("plan-out-under-file", [*PLAN_CMD, "--out", "{d}/text.txt/p.json"], 2),
    ("plan-out-long", [*PLAN_CMD, "--out", "{d}/" + LONG + ".json"], 2),
    # malformed predicted sections; diff regression checks
    ("show-predicted-str", ["show", "{d}/str.json"], 2),
    ("show-predicted-missing", ["show", "{d}/missing.json"], 2),
    ("show-predicted-stage", ["show", "{d}/stage.json"], 2),
    ("show-predicted-problems", ["show", "{d}/problems.json"], 2),
    ("diff-predicted-str", ["diff", "{d}/a.json", "{d}/str.json"], 2),
    ("diff-nan-refused", ["diff", "{d}/a.json", "{d}/nan.json", "--fail-on-regression", "0"], 2),
    ("diff-none-fails", ["diff", "{d}/a.json", "{d}/none.json", "--fail-on-regression", "0"], 1),
    ("diff-nan-a-refused", ["diff", "{d}/nan.json", "{d}/a.json", "--fail-on-regression", "0"], 2),
    # a recorded prediction that no cost model makes: NaN, infinite, negative, too large for a float
    *[(f"show-predicted-{name}", ["show", f"{{d}}/{name}.json"], 2)
      for name in ("nan", "inf", "negative", "huge", "stage-nan", "stage-negative")],
    ("launch-predicted-nan", ["launch", "{d}/nan.json", "-c", "{d}/cluster.json", "--out", "{d}/run"], 2),
    # other numbers of a plan file: huge integers, strings, an absurd model shape
    *[(f"show-plan-{name}", ["show", f"{{d}}/plan-{name}.json"], 2)
      for name in ("batch-huge", "seq-string", "hidden-huge", "eps-huge", "seed-huge")],
    ("launch-plan-batch-huge", ["launch", "{d}/plan-batch-huge.json", "-c", "{d}/cluster.json", "--out", "{d}/run"],
     2),
    # physically impossible cluster files: refused where any command loads them
    *[(f"plan-cluster-{name}", _plan_on(f"{{d}}/cluster-{name}.json"), 2) for name in BAD_CLUSTERS],
    *[(f"merge-cluster-{name}", ["profile", "merge", f"{{d}}/cluster-{name}.json", "--out", "{d}/merged.json"], 2)
      for name in BAD_CLUSTERS],
    ("show-cluster-slowdown-1e308", ["show", "{d}/plan.json", "-c", "{d}/cluster-slowdown-1e308.json"], 2),
    ("launch-cluster-memory-1e40", ["launch", "{d}/plan.json", "-c", "{d}/cluster-memory-1e40.json",
                                    "--out", "{d}/run"], 2),
    # layer profiles, cost parameters and prices with impossible numbers
    *[(f"plan-layers-{name}", _plan_on("{d}/cluster.json", "--layers", f"{{d}}/layers-{name}.json"), 2)
      for name in BAD_LAYERS],
    *[(f"plan-cost-params-{name}", _plan_on("{d}/cluster.json", "--cost-params", f"{{d}}/cost-{name}.json"), 2)
      for name in BAD_COST_PARAMS],
    *[(f"show-cost-params-{name}", ["show", "{d}/plan.json", "--cost-params", f"{{d}}/cost-{name}.json"], 2)
      for name in BAD_COST_PARAMS],
    ("show-layers-fwd-1e300", ["show", "{d}/plan.json", "--layers", "{d}/layers-fwd-1e300.json"], 2),
    *[(f"plan-prices-{name}", _plan_on("{d}/cluster.json", "--prices", f"{{d}}/prices-{name}.json"), 2)
      for name in BAD_PRICES],
    ("spec-slowdown-1e308", [*SYNTH, "1x4xcpu:slowdown=1e308", "--out", "{d}/c.json"], 2),
    ("spec-slowdown-below-1", [*SYNTH, "1x4xcpu:slowdown=0.5", "--out", "{d}/c.json"], 2),
    ("spec-bw-tiny", [*SYNTH, "1x4xcpu:bw=1e-300", "--out", "{d}/c.json"], 2),
    ("diff-threshold-nan", ["diff", "{d}/a.json", "{d}/a.json", "--fail-on-regression", "nan"], 2),
    ("diff-threshold-inf", ["diff", "{d}/a.json", "{d}/a.json", "--fail-on-regression", "inf"], 2),
    ("diff-threshold-negative", ["diff", "{d}/a.json", "{d}/a.json", "--fail-on-regression", "-1"], 2),
    # data prepare
    ("prepare-out-is-input", ["data", "prepare", "{d}/text.txt", "--out", "{d}/text.txt"], 2),
    ("prepare-out-is-tokenizer", ["data", "prepare", "{d}/text.txt", "--tokenizer", "{d}/tok.json",
                                  "--out", "{d}/tok.json"], 2),
    ("prepare-out-dir", ["data", "prepare", "{d}/text.txt", "--out", "{d}"], 2),
    ("prepare-out-empty", ["data", "prepare", "{d}/text.txt", "--out", ""], 2),
    ("prepare-out-under-file", ["data", "prepare", "{d}/text.txt", "--out", "{d}/text.txt/t.bin"], 2),
    ("prepare-out-long", ["data", "prepare", "{d}/text.txt", "--out", "{d}/" + LONG + ".bin"], 2),
    ("prepare-out-devnull", ["data", "prepare", "{d}/text.txt", "--out", "/dev/null"], 2),
    ("prepare-out-proc", ["data", "prepare", "{d}/text.txt", "--out", "/proc/flashflex-test.bin"], 2),
    ("prepare-input-long", ["data", "prepare", "{d}/" + LONG, "--out", "{d}/t.bin"], 2),
    # launch numbers
    ("launch-seed-negative", [*LAUNCH, "--seed", "-1", "--out", "{d}/run"], 2),
    ("launch-seed-2-32", [*LAUNCH, "--seed", str(2**32), "--out", "{d}/run"], 2),
    ("launch-lr-nan", [*LAUNCH, "--lr", "nan", "--out", "{d}/run"], 2),
    ("launch-lr-zero", [*LAUNCH, "--lr", "0", "--out", "{d}/run"], 2),
    ("launch-timeout-inf", [*LAUNCH, "--timeout", "inf", "--out", "{d}/run"], 2),
    ("launch-timeout-zero", [*LAUNCH, "--timeout", "0", "--out", "{d}/run"], 2),
    ("launch-steps-zero", [*LAUNCH, "--steps", "0", "--out", "{d}/run"], 2),
    ("launch-checkpoint-every", [*LAUNCH, "--checkpoint-every", "-1", "--checkpoint-dir", "{d}/ck",
                                 "--out", "{d}/run"], 2),
    ("launch-launcher", [*LAUNCH, "--launcher", "nope"], 2),
    # launch folders and data
    ("launch-out-is-file", [*LAUNCH, "--out", "{d}/text.txt"], 2),
    ("launch-out-under-file", [*LAUNCH, "--out", "{d}/text.txt/run"], 2),
    ("launch-out-long", [*LAUNCH, "--out", "{d}/" + LONG], 2),
    ("launch-ckpt-under-file", [*LAUNCH, "--out", "{d}/run", "--checkpoint-dir", "{d}/text.txt/ck"], 2),
    ("launch-ckpt-is-file", [*LAUNCH, "--out", "{d}/run", "--checkpoint-dir", "{d}/plan.json"], 2),
    ("launch-data-vocab", [*LAUNCH, "--out", "{d}/run", "--data", "{d}/badvocab.bin"], 2),
    ("launch-data-not-tokens", [*LAUNCH, "--out", "{d}/run", "--data", "{d}/text.txt"], 2),
    ("launch-data-dir", [*LAUNCH, "--out", "{d}/run", "--data", "{d}"], 2),
    ("launch-data-long", [*LAUNCH, "--out", "{d}/run", "--data", "{d}/" + LONG], 2),
    # rendered launch scripts
    ("render-port-zero", [*RENDER, "--port", "0"], 2),
    ("render-port-high", [*RENDER, "--port", "70000"], 2),
    ("render-hosts-empty", [*RENDER, "--hosts", ",,,,"], 2),
    ("render-hosts-trailing", [*RENDER, "--hosts", "a,"], 2),
    ("render-ifname-empty", [*RENDER, "--ifname", ",,"], 2),
    ("render-ifname-count", [*RENDER, "--ifname", "a,b,c"], 2),
    ("render-template-long", [*RENDER, "--template", "{d}/" + LONG], 2),
    ("render-template-binary", [*RENDER, "--template", "{d}/bin.tmpl"], 2),
    ("render-script-dir", [*RENDER, "--script", "{d}"], 2),
    ("render-script-is-plan", [*RENDER, "--script", "{d}/plan.json"], 2),
    ("render-script-is-cluster", [*RENDER, "--script", "{d}/cluster.json"], 2),
    ("render-script-empty", [*RENDER, "--script", ""], 2),
    ("render-script-long", [*RENDER, "--script", "{d}/" + LONG + ".sh"], 2),
    ("render-run-id-newline", [*RENDER, "--run-id", "x\ntouch {d}/pwned"], 2),
    ("render-torchrun-newline", [*RENDER, "--torchrun", "torchrun\ntouch {d}/pwned"], 2),
    ("render-host-newline", [*RENDER, "--hosts", "a,b\ntouch {d}/pwned"], 2),
    # --hosts entries that are no host name or IP address
    ("render-hosts-shell", [*RENDER, "--hosts", "a;rm -rf x,b"], 2),
    ("render-hosts-space", [*RENDER, "--hosts", "a b,c"], 2),
    ("render-hosts-dash", [*RENDER, "--hosts", "-oProxyCommand=x,b"], 2),
    ("render-hosts-bad-ipv4", [*RENDER, "--hosts", "10.0.0.256,b"], 2),
    ("render-hosts-bad-ipv6", [*RENDER, "--hosts", "::1::2,b"], 2),
    ("render-hosts-ipv6-zone", [*RENDER, "--hosts", "fe80::1%a;b,c"], 2),
    ("render-hosts-long-label", [*RENDER, "--hosts", "a" * 64 + ",b"], 2),
    ("render-hosts-underscore", [*RENDER, "--hosts", "my_host,b"], 2),
    ("render-cluster-hostname", [*LAUNCH, "--launcher", "torchrun", "-c", "{d}/cluster-hostname-shell.json"], 2),
    ("slurm-job-name-newline", [*LAUNCH, "--launcher", "slurm", "--job-name", "x\ntouch {d}/pwned"], 2),
    ("slurm-job-name-space", [*LAUNCH, "--launcher", "slurm", "--job-name", "a b"], 2),
    ("slurm-job-name-subst", [*LAUNCH, "--launcher", "slurm", "--job-name", "$(touch {d}/pwned)"], 2),
]


@pytest.mark.parametrize(("argv", "code"), [pytest.param(argv, code, id=name) for name, argv, code in CASES])
def test_bad_input_is_one_line_and_touches_nothing(workspace: Path, argv: list[str], code: int,
                                                   capsys: pytest.CaptureFixture[str],
                                                   no_launch: list[object]) -> None:
    before = _snapshot(workspace)
    result = main([arg.replace("{d}", str(workspace)) for arg in argv])
    err = capsys.readouterr().err
    assert result == code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), err
    if code == 2:
        assert len(lines) == 1, err
    assert _snapshot(workspace) == before
    assert not no_launch


def test_no_checkpoint_space_fails_before_any_worker(workspace: Path, capsys: pytest.CaptureFixture[str],
                                                     no_launch: list[object],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flashflex_cli.launch.preflight.shutil.disk_usage",
                        lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))  # type: ignore[attr-defined]
    before = _snapshot(workspace)
    code = main([*[a.replace("{d}", str(workspace)) for a in LAUNCH], "--out", str(workspace / "run"),
                 "--checkpoint-dir", str(workspace / "ck")])
    err = capsys.readouterr().err
    assert code == 1 and not no_launch
    # 234,048 parameters x 16 bytes = 3.57 MiB against 1000 bytes: both in a unit that shows them
    assert "checkpoint needs about 3.57 MiB" in err and "1000 B free" in err and "234,048 parameters" in err
    assert err.strip().splitlines()[-1].startswith("error: --checkpoint-dir")
    assert _snapshot(workspace) == before


def test_diff_json_stays_strict_json_without_a_prediction(workspace: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(workspace / "a.json"), str(workspace / "none.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"non-JSON {name}"))
    assert out["metrics"]["tokens_per_s"]["b"] is None


@pytest.mark.parametrize(("argv", "named"), [
    (_plan_on("{d}/cluster-memory-1e40.json"),
     ["cluster-memory-1e40.json: nodes.0.devices.0.memory_bytes:", "1.00 PiB", "an integer of 41 digits"]),
    (_plan_on("{d}/cluster-slowdown-1e308.json"),
     ["cluster-slowdown-1e308.json: nodes.0.devices.0.slowdown:", "[1, 10000]", "got 1e+308"]),
    (["profile", "merge", "{d}/cluster-pair-bw-tiny.json", "--out", "{d}/m.json"],
     ["cluster-pair-bw-tiny.json: inter_node.pairs.0.bandwidth:", "B/s", "got 1e-300"]),
    (_plan_on("{d}/cluster-memory-string.json"),
     ["nodes.0.devices.0.memory_bytes: must be a number, got '4294967296'"]),
    (["show", "{d}/nan.json"], ["nan.json: predicted.tokens_per_s must be a finite number, got nan"]),
    (["show", "{d}/inf.json"], ["inf.json: predicted.iteration_time_s must be a finite number, got inf"]),
    (["show", "{d}/plan.json", "--cost-params", "{d}/cost-truncated.json"], ["cost-truncated.json: malformed JSON"]),
    (["show", "{d}/plan.json", "--cost-params", "{d}/cost-efficiency-tiny.json"],
     ["cost-efficiency-tiny.json: cost parameters: tp_comm_efficiency must be in [0.0001, 1], got 1e-300"]),
    (_plan_on("{d}/cluster.json", "--layers", "{d}/layers-fwd-1e300.json"),
     ["layers-fwd-1e300.json: entries.0.layer.fwd_s: must be in [0, 1e+06] s, got 1e+300"]),
    ([*RENDER, "--hosts", "a;rm -rf x,b"], ["--hosts entry 'a;rm -rf x' is not a host name or IP address"]),
])
def test_refusals_name_the_file_the_field_and_the_value(workspace: Path, argv: list[str], named: list[str],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main([arg.replace("{d}", str(workspace)) for arg in argv]) == 2
    err = capsys.readouterr().err
    for text in named:
        assert text in err, err


def test_host_names_and_addresses_are_rendered(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """RFC 1123 names (a trailing root dot too), IPv4 and IPv6 (an endpoint's IPv6 host in brackets)."""
    argv = [arg.replace("{d}", str(workspace)) for arg in RENDER] + ["--out", str(workspace / "run")]
    assert main([*argv, "--hosts", "::1,gpu-2.example.org."]) == 0
    out = capsys.readouterr().out
    assert "[::1]:" in out and "gpu-2.example.org." in out
    assert main([*argv, "--hosts", "10.0.0.1,fe80::1%eth0"]) == 0


def test_token_ids_scan_finds_the_largest_id_in_chunks(tmp_path: Path) -> None:
    path = tmp_path / "t.bin"
    token_data.write_token_file(path, list(range(50)) + [7] * 1000, 256)
    assert token_data.TokenFile(path).max_token(chunk=16) == 49


@pytest.mark.parametrize("header", [(b"FLXTOKEN", 1, 2, 0, 0), (b"FLXTOKEN", 1, 3, 256, 0),
                                    (b"FLXTOKEN", 2, 2, 256, 0), (b"FLXTOKEN", 1, 2, 256, 10**12)])
def test_token_header_fields_are_checked(tmp_path: Path, header: tuple) -> None:
    path = tmp_path / "t.bin"
    path.write_bytes(token_data._HEADER.pack(*header).ljust(token_data.HEADER_BYTES, b"\0"))
    with pytest.raises(InputError):
        token_data.TokenFile(path)


def test_output_checks_name_the_problem(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    for path, text in ((tmp_path, "is a folder"), (tmp_path / "f" / "x", "is not a folder"),
                       (tmp_path / LONG, "file name too long"), ("", "empty path")):
        with pytest.raises(InputError, match=text):
            check_writable_output(path)
    assert check_writable_output(tmp_path / "new" / "deeper" / "x.json") == tmp_path / "new" / "deeper" / "x.json"
    with pytest.raises(InputError, match="is a file"):
        check_writable_dir(tmp_path / "f", "--out")
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(__import__("os").geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir(mode=0o500)
    with pytest.raises(InputError, match="not writable"):
        check_writable_output(folder / "x.json")


# ---- real processes -------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "code"), [
    (["data", "prepare", "{d}/text.txt", "--out", "{d}/text.txt"], 2),
    ([*SYNTH, "1x4xcpu", "--out", "{d}"], 2),
    ([*LAUNCH, "--seed", "-1"], 2),
    (["diff", "{d}/a.json", "{d}/nan.json", "--fail-on-regression", "0"], 2),
    (["diff", "{d}/a.json", "{d}/none.json", "--fail-on-regression", "0"], 1),
    (_plan_on("{d}/cluster-memory-1e40.json"), 2),
], ids=["prepare-same-file", "profile-out-dir", "launch-seed", "diff-nan", "diff-none", "plan-memory-1e40"])
def test_console_script_reports_one_line(workspace: Path, argv: list[str], code: int) -> None:
    before = _snapshot(workspace)
    result = subprocess.run([FLASHFLEX, *[a.replace("{d}", str(workspace)) for a in argv]],
                            capture_output=True, text=True, timeout=120, cwd=workspace)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    if code == 2:
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert _snapshot(workspace) == before


def test_concurrent_prepares_to_one_output_all_succeed(workspace: Path) -> None:
    out = workspace / "data.bin"
    procs = [subprocess.Popen([FLASHFLEX, "data", "prepare", str(workspace / "text.txt"), "--out", str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = [(p.wait(timeout=120), p.stderr.read() if p.stderr else "") for p in procs]
    assert all(code == 0 for code, _ in results), results
    assert len(token_data.TokenFile(out)) == len((workspace / "text.txt").read_bytes())
    assert not [p.name for p in workspace.iterdir() if p.name.endswith(".tmp")]

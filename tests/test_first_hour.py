"""What a new user meets in the first hour, beyond training itself: output that pipes (results on stdout,
diagnostics on stderr, --json unchanged), numbers that flag themselves (MFU above 100%, a measured/predicted ratio
outside the stated band, emulated devices that need more cores than the host has, a gain within the model's error),
plans named after their config, help that keeps option names whole at 80 columns, Markdown accepted as text, a
vocabulary mismatch that says what to do, a byte-level tokenizer that matches `data prepare`, and diff and show
writing layer ranges and idle devices alike."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.launch.preflight import core_share_warning
from flashflex_cli.model.hf_config import config_name
from flashflex_cli.plan.render import gain_line
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.plan.text import layer_text
from flashflex_cli.runtime.training.metrics import MetricsLog, run_summary
from flashflex_cli.semantics.stated_error import MEDIAN_STEP_ERROR, ratio_is_suspect
from tests.conftest import FLASHFLEX

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = GOLDEN / "cluster-2node.json"
COMMANDS = (["plan"], ["show"], ["diff"], ["launch"], ["profile"], ["profile", "merge"], ["calibrate"], ["export"],
            ["data", "prepare"])


def test_show_writes_its_tables_to_stdout_and_json_alone_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(GOLDEN / "plan-3rank.json")]) == 0
    out = capsys.readouterr()
    assert "memory GiB" in out.out and "predicted:" in out.out and out.err == ""
    assert main(["show", str(GOLDEN / "plan-3rank.json"), "--json"]) == 0
    out = capsys.readouterr()
    json.loads(out.out)  # nothing but the plan on stdout
    assert "memory GiB" in out.err  # the tables moved to stderr


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A plan of llama-tiny on the 2-node test cluster, and what `flashflex plan` printed on stdout."""
    import contextlib
    import io

    plan = tmp_path_factory.mktemp("plan") / "p.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(CLUSTER), "--model", "llama-tiny", "--global-batch", "8", "--seq-len", "32",
                     "--dtype", "fp32", "--time-budget", "5", "--out", str(plan)]) == 0
    return plan, out.getvalue()


def test_plan_and_diff_write_results_to_stdout(planned: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    plan, out = planned
    assert "predicted:" in out and "ratio flashflex / uniform" in out and f"wrote {plan}" in out
    assert main(["diff", str(GOLDEN / "plan-3rank.json"), str(plan)]) == 0
    assert "diff " in capsys.readouterr().out


def test_show_pipes_into_a_pager_with_whole_table_rows(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # stdout is a pipe here, as in `flashflex show plan.json | less`
    assert main(["show", str(GOLDEN / "plan-3rank.json")]) == 0
    out = capsys.readouterr()
    rows = [line for line in out.out.splitlines() if "node0/" in line and "│" in line]
    assert rows and all(re.search(r"\d+-\d+ \(\d+\)", line) for line in rows)  # each stage row on one line
    assert out.err == ""


def test_a_piped_launch_shows_its_refusal_on_stderr_only(tmp_path: Path) -> None:
    done = subprocess.run(f"{FLASHFLEX} launch {GOLDEN / 'plan-1rank.json'} --cluster {CLUSTER} --steps 0 | cat",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert done.stdout == "" and done.stderr.startswith("error: --steps")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_keeps_every_option_name_whole_at_80_columns(command: list[str], capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert main([*command, "--help"]) == 0
    text = capsys.readouterr().out
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80 and "--help" in text


def test_a_plan_mfu_above_100_percent_is_flagged(planned: tuple[Path, str], capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    plan = load_plan(planned[0])
    inflated = plan.model_copy(update={"predicted": {**(plan.predicted or {}), "mfu": 1.749}})
    path = tmp_path / "p.json"
    path.write_text(inflated.to_json())
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "MFU 174.9% is above 100%" in out and "flashflex profile" in out


def test_a_step_mfu_above_100_percent_is_flagged_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = MetricsLog(tmp_path, total_steps=3, flops_per_token=1e9, peak_flops=1e9, device_type="cpu")
    for step in (1, 2, 3):
        log.record(step, 2.0, tokens=10, step_time_s=5.0, lr=1e-3, grad_norm=1.0, memory_bytes=2**30, stages=[])
    log.close()
    err = capsys.readouterr().err
    assert err.count("is above 100%") == 1 and "catalog peak is a guess" in err
    assert "mem  1.00 GiB resident" in err and "elapsed " in err and "eta " in err
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["launch"], r["memory_kind"], r["tokens"]) for r in rows] == \
        [(1, 0, "resident", 10), (2, 0, "resident", 10), (3, 0, "resident", 10)]


def test_the_run_summary_flags_a_ratio_outside_the_band_and_names_the_checkpoint() -> None:
    rows = [{"step": s, "loss": 5.0 - s / 10, "step_time_s": 0.4, "tokens": 100, "memory_bytes": 2**30,
             "memory_kind": "allocated"} for s in range(11, 21)]
    lines = run_summary(rows, 20, 125.0, predicted_step_s=0.1, compile_s=3.0, checkpoint="ck/step-000020",
                        metrics_path="run/metrics.jsonl")
    text = "\n".join(lines)
    assert lines[0] == "done: steps 11-20 of 20 in 2m05s wall, 1,000 tokens, loss 3.9000 -> 3.0000"
    assert "measured/predicted 4.00" in text and "compile warm-up 3.0 s" in text
    assert "warning: measured/predicted 4.00 is outside 0.67-1.50" in text
    assert "1.00 GiB peak allocated" in text and "checkpoint: ck/step-000020" in text
    assert text.count("metrics.jsonl") == 1
    calm = run_summary(rows, 20, 1.0, predicted_step_s=0.38, compile_s=None, checkpoint=None, metrics_path="m")
    assert not any(line.startswith("warning") for line in calm) and "checkpoint: none" in calm[-2]


def test_the_band_lies_beyond_the_stated_error() -> None:
    assert not ratio_is_suspect(1.0 + 2 * MEDIAN_STEP_ERROR) and not ratio_is_suspect(0.8)
    assert ratio_is_suspect(0.27) and ratio_is_suspect(3.4)


def test_emulated_devices_beyond_the_host_cores_are_flagged_with_their_slowdowns() -> None:
    plan = load_plan(GOLDEN / "plan-4rank.json")
    cluster = load_cluster(CLUSTER)
    need = sum(1.0 / max(1.0, cluster.device(d).slowdown) for d in (i.device for i in plan.ranks()))
    line = core_share_warning(plan, cluster, cores=[0])
    assert line is not None and "4 emulated devices" in line and f"{need:.1f}x slower" in line
    assert core_share_warning(plan, cluster, cores=[0, 1, 2, 3]) is None
    slow = load_cluster(CLUSTER).model_copy(deep=True)
    for node in slow.nodes:  # the same devices four times slower: their compute fits one core
        for device in node.devices:
            object.__setattr__(device, "slowdown", 4.0)
    assert core_share_warning(plan, slow, cores=[0]) is None


def test_the_gain_over_the_symmetric_layout_is_shown_beside_the_stated_error() -> None:
    assert "within the cost model's stated error" in gain_line("flashflex", 1.02)
    assert "within" not in gain_line("flashflex", 1.35) and "1.35x" in gain_line("flashflex", 1.35)


def test_configs_are_named_after_their_name_file_or_shape() -> None:
    shape = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24}
    assert config_name({**shape, "_name_or_path": "Qwen/Qwen2-0.5B"}, "x/config.json") == "Qwen/Qwen2-0.5B"
    assert config_name(shape, "models/qwen-small.json") == "qwen-small"
    assert config_name(shape, "models/qwen2/config.json") == "qwen2"
    assert config_name(shape, "config.json") == "qwen2-h896-l24"
    assert config_name({**shape, "hidden_size": 1024}, "config.json") != config_name(shape, "config.json")


def test_markdown_is_text_and_a_vocabulary_mismatch_says_what_to_do(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.md").write_text("# Notes\n\nbyte-level text ü\n")
    data = tmp_path / "data.bin"
    assert main(["data", "prepare", str(tmp_path / "notes.md"), "--out", str(data)]) == 0
    assert f"wrote {data}" in capsys.readouterr().out
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
                                "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 64}))
    plan = tmp_path / "p.json"
    assert main(["plan", str(CLUSTER), "--model", str(tiny), "--global-batch", "4", "--seq-len", "8",
                 "--dtype", "fp32", "--time-budget", "5", "--no-baseline", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["launch", str(plan), "--data", str(data), "--out", str(tmp_path / "run"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "vocab_size 64" in err and '"vocab_size": 256' in err and "config.json" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_a_wrote_line_names_its_file_whole_however_long_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A path longer than the console (160 columns piped, 80 here through COLUMNS) is not broken across lines, so
    `grep wrote` finds it whole."""
    deep = tmp_path / ("a-long-folder-name-" * 6) / ("another-long-folder-name-" * 6)
    deep.mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("some text\n")
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["data", "prepare", str(tmp_path / "notes.txt"), "--out", str(deep / "data.bin")]) == 0
    assert f"wrote {deep / 'data.bin'}: " in capsys.readouterr().out
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", str(CLUSTER), "--model", "llama-tiny", "--global-batch", "4", "--seq-len", "8", "--dtype",
                 "fp32", "--time-budget", "5", "--no-baseline", "--out", str(deep / "plan.json")]) == 0
    assert f"  wrote {deep / 'plan.json'}\n" in capsys.readouterr().out


def test_the_byte_level_tokenizer_gives_the_ids_data_prepare_writes(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from flashflex_cli.data.token_file import TokenFile
    from flashflex_cli.hf.byte_tokenizer import byte_tokenizer_json

    text = "Grüße, 世界!\n\ttabs and  spaces ~ \x7f"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    assert main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "a.bin"), "--json"]) == 0
    prepared = [int(t) for t in TokenFile(tmp_path / "a.bin").tokens]
    tokenizer = Tokenizer.from_str(byte_tokenizer_json())
    ids = tokenizer.encode(text).ids
    assert ids == prepared[: len(ids)] == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_diff_and_show_write_layer_ranges_and_idle_devices_alike(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    a = load_plan(GOLDEN / "plan-3rank.json")
    data = json.loads(a.to_json())
    data["pipelines"][0]["stages"][0]["layers"], data["pipelines"][0]["stages"][1]["layers"] = [0, 3], [3, 4]
    b = type(a).model_validate(data)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(a.to_json())
    pb.write_text(b.to_json())
    assert main(["diff", str(pa), str(pb)]) == 0
    diff = capsys.readouterr().out
    old, new = layer_text(a.pipelines[0].stages[0].layers), layer_text([0, 3])
    assert f"layers {old} -> {new}" in diff
    assert main(["show", str(pb)]) == 0
    assert new in capsys.readouterr().out


def test_idle_devices_of_a_diff_share_one_line() -> None:
    from flashflex_cli.plan.diff import diff_plans
    from flashflex_cli.plan.schema import UnusedDevice

    a = load_plan(GOLDEN / "plan-3rank.json")
    idle = [UnusedDevice(device=f"node9/{i}", reason="slow") for i in range(8)]
    b = a.model_copy(update={"unused_devices": idle})
    lines = [line for line in diff_plans(a, b).changes if "now idle" in line]
    assert lines == ["unused: node9/0-7 now idle"]

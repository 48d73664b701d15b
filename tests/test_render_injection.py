"""Rendered launch scripts are injection-proof: every substituted value is one shell word (or refused).

Each hostile value is rendered into a torchrun script, checked with `bash -n`, then the script is run with
a fake `torchrun` first on PATH that records its argv: the payload never runs (its marker file never
appears) and the hostile value arrives as ONE argument, or, for the settings the workers read from the run
configuration (RUN/config.json), as that file's value.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from flashflex_cli.cli import main
from flashflex_cli.data.token_file import write_token_file
from flashflex_cli.errors import InputError
from flashflex_cli.hardware.cluster import Cluster, load_cluster
from flashflex_cli.launch.options import launch_config
from flashflex_cli.launch.slurm import SlurmSettings, render_slurm
from flashflex_cli.launch.templates import render, sbatch_word, shell_word
from flashflex_cli.launch.torchrun import RenderSettings, render_torchrun
from flashflex_cli.plan.schema import load_plan
from flashflex_cli.run_config import RunConfig, load_run_config

GOLDEN = Path(__file__).parent / "golden"
PAYLOADS = ["$(touch {m})", "`touch {m}`", "; touch {m}", "x' ; touch {m}; '", 'x" ; touch {m}; "',
            "a b && touch {m} #", "|touch {m}", "$'\\x41'", "${{IFS}}touch${{IFS}}{m}"]
FAKE_TORCHRUN = """#!/bin/sh
out=$(mktemp "$ARGV_DIR/call.XXXXXX")
printf '%s\\0' "GLOO=${GLOO_SOCKET_IFNAME-}" "NCCL=${NCCL_SOCKET_IFNAME-}" "$@" > "$out"
"""


@pytest.fixture
def fake_path(tmp_path: Path) -> dict[str, str]:
    """Environment whose PATH starts with a `torchrun` stub recording each call's argv under ARGV_DIR."""
    bin_dir, argv_dir = tmp_path / "bin", tmp_path / "argv"
    bin_dir.mkdir()
    argv_dir.mkdir()
    stub = bin_dir / "torchrun"
    stub.write_text(FAKE_TORCHRUN)
    stub.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGV_DIR": str(argv_dir)}


def _calls(env: dict[str, str]) -> list[list[str]]:
    """The argv of every recorded torchrun call, in --node-rank order."""
    calls = [p.read_bytes().decode().split("\0")[:-1] for p in Path(env["ARGV_DIR"]).iterdir()]
    return sorted(calls, key=lambda argv: next(a for a in argv if a.startswith("--node-rank=")))


def _render_and_run(tmp_path: Path, env: dict[str, str], *extra: str, plan: Path | None = None,
                    data: str = "synthetic") -> list[list[str]]:
    """Render the 4-rank plan through the CLI with `extra` options (in `tmp_path`: relative run folders go there),
    `bash -n` it, run it; the argv of each torchrun call."""
    script = tmp_path / "launch.sh"
    with contextlib.chdir(tmp_path):
        code = main(["launch", str(plan or GOLDEN / "plan-4rank.json"), "-c", str(GOLDEN / "cluster-2node.json"),
                     "--launcher", "torchrun", "--data", data, "--script", str(script), *extra])
    assert code == 0
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    run = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return _calls(env)


def _config(plan: str, cluster: str, out: str) -> RunConfig:
    return launch_config(plan=plan, cluster=cluster, out=out)


def _payload(template: str, marker: Path) -> str:
    return template.format(m=marker)


@pytest.mark.parametrize("template", PAYLOADS)
@pytest.mark.parametrize("option", ["--run-id", "--ifname", "--out", "--checkpoint-dir"])
def test_hostile_option_is_one_argument_and_never_runs(tmp_path: Path, fake_path: dict[str, str],
                                                      option: str, template: str) -> None:
    marker = tmp_path / "pwned"
    value = _payload(template, marker)
    calls = _render_and_run(tmp_path, fake_path, option, value)
    assert not marker.exists()
    assert len(calls) == 2
    for argv in calls:
        if option == "--run-id":
            assert f"--rdzv-id={value}" in argv
        elif option == "--ifname":
            assert argv[0] == f"GLOO={value}"
            assert argv[1] == f"NCCL=={value}"  # "=": NCCL's exact-name form
        elif option == "--out":
            assert argv[argv.index("--config") + 1] == os.path.join(value, "config.json")
            assert load_run_config(tmp_path / value / "config.json").out == value
        else:
            assert load_run_config(tmp_path / "runs" / "run" / "config.json").checkpoint_dir == value


@pytest.mark.parametrize("template", PAYLOADS)
def test_hostile_host_is_refused_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          template: str) -> None:
    marker, script = tmp_path / "pwned", tmp_path / "launch.sh"
    code = main(["launch", str(GOLDEN / "plan-4rank.json"), "-c", str(GOLDEN / "cluster-2node.json"),
                 "--launcher", "torchrun", "--script", str(script), "--hosts", f"h0,{_payload(template, marker)}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--hosts entry" in err
    assert not script.exists() and not marker.exists()


def test_hosts_reach_torchrun_as_addresses(tmp_path: Path, fake_path: dict[str, str]) -> None:
    calls = _render_and_run(tmp_path, fake_path, "--hosts", "h0,10.0.0.2")
    assert "--rdzv-endpoint=h0:29500" in calls[0] and "--local-addr=10.0.0.2" in calls[1]


@pytest.mark.parametrize("template", PAYLOADS[:4])
def test_hostile_file_names_reach_the_worker_as_one_argument(tmp_path: Path, fake_path: dict[str, str],
                                                            template: str) -> None:
    marker = tmp_path / "pwned"
    folder = tmp_path / "in"
    folder.mkdir()
    name = _payload(template, marker).replace("/", "_")
    plan, data = folder / f"{name}.json", folder / f"{name}.bin"
    shutil.copy(GOLDEN / "plan-4rank.json", plan)
    write_token_file(data, list(range(200)) * 10, 256)
    calls = _render_and_run(tmp_path, fake_path, plan=plan, data=str(data))
    assert not marker.exists()
    config = load_run_config(tmp_path / "runs" / "run" / "config.json")
    assert (config.plan, config.data) == (str(plan), str(data))
    for argv in calls:
        assert argv[argv.index("--config") + 1] == "runs/run/config.json"


@pytest.mark.parametrize("template", PAYLOADS[:3])
def test_hostile_torchrun_executable_is_never_split(tmp_path: Path, fake_path: dict[str, str],
                                                   template: str) -> None:
    marker = tmp_path / "pwned"
    script = tmp_path / "launch.sh"
    assert main(["launch", str(GOLDEN / "plan-4rank.json"), "-c", str(GOLDEN / "cluster-2node.json"),
                 "--launcher", "torchrun", "--torchrun", _payload(template, marker), "--script", str(script),
                 "--out", str(tmp_path / "run")]) == 0
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    run = subprocess.run(["bash", str(script)], env=fake_path, cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 127  # one word naming no program: nothing ran
    assert not marker.exists()


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\tb", "a\x1bb", "a\x00b", "a\u2028b"])
@pytest.mark.parametrize("option", ["--run-id", "--torchrun", "--hosts", "--ifname", "--out"])
def test_control_characters_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str,
                                        value: str) -> None:
    script = tmp_path / "launch.sh"
    extra = ["--hosts", f"h0,{value}"] if option == "--hosts" else [option, value]
    code = main(["launch", str(GOLDEN / "plan-4rank.json"), "-c", str(GOLDEN / "cluster-2node.json"),
                 "--launcher", "torchrun", "--script", str(script), *extra])
    err = capsys.readouterr().err
    assert code == 2 and not script.exists()
    if option != "--out" or "\0" not in value:  # typer refuses a NUL in a path itself (a usage error)
        assert len(err.strip().splitlines()) == 1 and "control characters" in err


def _slurm(tmp_path: Path, **settings: str) -> str:
    plan, cluster = load_plan(GOLDEN / "plan-4rank.json"), load_cluster(GOLDEN / "cluster-2node.json")
    options = _config(plan="plan.json", cluster="cluster.json", out=settings.pop("out", "runs/r"))
    render = RenderSettings(torchrun=settings.pop("torchrun", "torchrun"),
                            ifnames=tuple(filter(None, [settings.pop("ifname", "")])))
    return render_slurm(plan, cluster, options, render, SlurmSettings(**settings))


@pytest.mark.parametrize("template", [None, "slurm", "slurm-hetjob"])
@pytest.mark.parametrize("payload", PAYLOADS[:5])
def test_slurm_scripts_quote_shell_values(tmp_path: Path, template: str | None, payload: str) -> None:
    marker = tmp_path / "pwned"
    value = _payload(payload, marker)
    plan, cluster = load_plan(GOLDEN / "plan-4rank.json"), load_cluster(GOLDEN / "cluster-2node.json")
    text = render_slurm(plan, cluster, _config(plan=value, cluster="c.json", out=value),
                        RenderSettings(torchrun=value, ifnames=(value,), template=template), SlurmSettings())
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert all("pwned" not in line for line in sbatch)
    assert "srun" in text and shell_word(value, "x") in text


@pytest.mark.parametrize("name", ["a\nsrun touch /tmp/x", "a b", "a#b", 'a"b', "a'b", "$(id)", "a\\b", ""])
def test_sbatch_values_outside_the_safe_set_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(InputError):
        _slurm(tmp_path, job_name=name)
    with pytest.raises(InputError):
        _slurm(tmp_path, log=name)
    with pytest.raises(InputError):
        _slurm(tmp_path, sbatch_extra=(f"#SBATCH --comment={name}\nrm -rf x",))  # type: ignore[arg-type]


def _with_hostname(node: int, hostname: str) -> Cluster:
    """The golden cluster with node `node`'s hostname set past the schema (which refuses what is no host name),
    to test the renderers' own quoting and refusals."""
    cluster = load_cluster(GOLDEN / "cluster-2node.json")
    data = cluster.model_dump(mode="json", by_alias=True)
    data["nodes"][node]["hostname"] = hostname
    with pytest.raises(ValidationError, match=r"nodes\.\d\.hostname"):
        Cluster.model_validate(data)
    nodes = list(cluster.nodes)
    nodes[node] = nodes[node].model_copy(update={"hostname": hostname})
    return cluster.model_copy(update={"nodes": nodes})


def test_hostile_cluster_hostname_is_refused_in_sbatch_lines() -> None:
    cluster = _with_hostname(0, "n0\n#SBATCH --wrap=touch /tmp/x")
    with pytest.raises(InputError, match="control characters"):
        render_slurm(load_plan(GOLDEN / "plan-4rank.json"), cluster, _config(plan="p", cluster="c", out="o"),
                     RenderSettings(), SlurmSettings())


def test_cluster_hostname_outside_the_sbatch_set_is_refused() -> None:
    cluster = _with_hostname(0, "n0 --wrap=x")
    with pytest.raises(InputError, match="hostname of node node0"):
        render_slurm(load_plan(GOLDEN / "plan-4rank.json"), cluster,
                     _config(plan="p", cluster="c", out="o"), RenderSettings(), SlurmSettings())


def test_hostile_cluster_hostname_is_quoted_in_torchrun_scripts(tmp_path: Path, fake_path: dict[str, str]) -> None:
    marker = tmp_path / "pwned"
    text = render_torchrun(load_plan(GOLDEN / "plan-4rank.json"), _with_hostname(1, f"$(touch {marker})"),
                           _config(plan="p", cluster="c", out="o"), RenderSettings())
    script = tmp_path / "t.sh"
    script.write_text(text)
    assert subprocess.run(["bash", str(script)], env=fake_path, capture_output=True).returncode == 0
    assert not marker.exists()
    assert f"--local-addr=$(touch {marker})" in _calls(fake_path)[1]


def test_render_refuses_control_characters_in_any_value(tmp_path: Path) -> None:
    template = tmp_path / "t.tmpl"
    template.write_text("echo {{ a }}\n")
    assert render(template, {"a": "ok"}, []) == "echo ok\n"
    with pytest.raises(InputError, match="control characters"):
        render(template, {"a": "x\ntouch y"}, [])
    assert sbatch_word("runs/slurm-%j.out", "log") == "runs/slurm-%j.out"
    assert shell_word("plain-word_1.2", "x") == "plain-word_1.2"

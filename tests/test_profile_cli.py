"""`flashflex profile` CLI: synthetic profiles, merge, bundled profiles, one-line errors with exit 2."""

from __future__ import annotations

import json
import re
import shlex
import subprocess

import pytest

from flashflex_cli.cli import main
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.hardware.probe_gloo import LOOPBACK_LIMITS
from tests.conftest import FLASHFLEX

BUNDLED = ["paper-hetero-1", "paper-hetero-2", "paper-hetero-3", "paper-homo-a100-2x8", "paper-homo-a100-4x8",
           "holmes-mixed-nic", "cpu-emulated"]


def _script_profiles(repo) -> list[tuple[str, str, str]]:
    """(name, spec, description) of every `profile NAME 'SPEC' 'DESCRIPTION'` line of make_profiles.sh."""
    rows = []
    for line in (repo / "scripts" / "make_profiles.sh").read_text().splitlines():
        if line.startswith("profile "):
            _, name, spec, description = shlex.split(line)
            rows.append((name, spec, description))
    return rows


def test_synthetic_writes_a_valid_cluster_and_a_summary(tmp_path, capsys):
    out = tmp_path / "c.json"
    code = main(["profile", "--synthetic", "1x8xA100-80G-SXM:nic=ib,3x8x4090:nic=eth", "--out", str(out),
                 "--description", "demo"])
    assert code == 0
    cluster = load_cluster(out)
    assert cluster.name == "c" and cluster.description == "demo"
    assert len(cluster.device_ids) == 32 and [n.nic for n in cluster.nodes] == ["ib", "eth", "eth", "eth"]
    captured = capsys.readouterr()
    assert captured.err == ""  # the summary is the result: on stdout, so that it pipes
    assert "RTX-4090" in captured.out and "wrote" in captured.out


def test_bundled_profiles_regenerate_byte_for_byte(repo, tmp_path, capsys):
    rows = _script_profiles(repo)
    assert sorted(name for name, _, _ in rows) == sorted(BUNDLED)
    for name, spec, description in rows:
        out = tmp_path / f"{name}.json"
        assert main(["profile", "--synthetic", spec, "--name", name, "--description", description,
                     "--out", str(out)]) == 0
        committed = repo / "profiles" / f"{name}.json"
        assert committed.read_text() == out.read_text(), f"{committed} is stale: run `make profiles`"


def test_bundled_profiles_describe_the_papers_clusters(repo):
    def load(name):
        return load_cluster(repo / "profiles" / f"{name}.json")

    def types(cluster):
        return [d.type for n in cluster.nodes for d in n.devices]

    hetero1 = types(load("paper-hetero-1"))
    assert (hetero1.count("RTX-3080Ti"), hetero1.count("RTX-3090"), hetero1.count("RTX-4090")) == (8, 8, 24)
    hetero2 = load("paper-hetero-2")
    assert len(hetero2.nodes) == 4 and hetero2.nodes[3].intra_link.kind == "nvlink"
    assert types(hetero2).count("A100-80G-SXM") == 8
    hetero3 = load("paper-hetero-3")
    assert [len(n.devices) for n in hetero3.nodes] == [8, 4, 4, 8, 8, 8, 8, 8]
    for name, nodes in (("paper-homo-a100-2x8", 2), ("paper-homo-a100-4x8", 4)):
        homo = load(name)
        assert len(homo.nodes) == nodes and set(types(homo)) == {"A100-80G-PCIe"}
        assert {n.nic for n in homo.nodes} == {"eth"}
    assert {n.nic for n in load("holmes-mixed-nic").nodes} == {"ib", "roce", "eth"}
    cpu = load("cpu-emulated")
    assert len(cpu.device_ids) == 4 and len({d.slowdown for d in cpu.nodes[0].devices}) > 1
    assert all(d.type == "cpu" and d.memory_bytes >= 2**30 for d in cpu.nodes[0].devices)
    for name in BUNDLED:
        cluster = load(name)
        assert cluster.name == name and cluster.description


@pytest.mark.parametrize("cpu_devices", [1, 2])
def test_quick_cpu_profile_records_the_gloo_link(tmp_path, capsys, cpu_devices):
    out = tmp_path / "me.json"
    assert main(["profile", "--quick", "--cpu-devices", str(cpu_devices), "--out", str(out)]) == 0
    node = load_cluster(out).nodes[0]
    link = node.intra_link
    assert len(node.devices) == cpu_devices and link.kind == "shm"
    if cpu_devices == 1:  # one process: no inter-process link was measured
        assert link.bandwidth is None and link.latency_s is None
        assert "gloo" not in capsys.readouterr().err
    else:  # two processes over gloo/loopback TCP, not a host memcpy
        assert LOOPBACK_LIMITS.plausible(link.bandwidth, link.latency_s)
        assert "gloo" in capsys.readouterr().err


def test_merge_combines_node_files(tmp_path, capsys):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "ab.json"
    assert main(["profile", "--synthetic", "1x2x4090:name=left", "--out", str(a)]) == 0
    assert main(["profile", "--synthetic", "2x1xcpu:name=right", "--out", str(b)]) == 0
    assert main(["profile", "merge", str(a), str(b), "--out", str(out)]) == 0
    merged = load_cluster(out)
    assert [n.name for n in merged.nodes] == ["left0", "right0", "right1"]
    assert merged.name == "ab"


def _assert_one_line_error(code, capsys, *needles):
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [("1x8xA100-80", "A100-80G-SXM"), ("1x8", "malformed"), ("1x4xcpu:slowdown=1,2", "slowdown")],
)
def test_bad_spec_exits_2_and_leaves_existing_output_alone(tmp_path, capsys, spec, needle):
    out = tmp_path / "c.json"
    out.write_text("previous\n")
    code = main(["profile", "--synthetic", spec, "--out", str(out)])
    _assert_one_line_error(code, capsys, needle)
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]  # no temporary file left behind


def test_bad_merge_inputs(tmp_path, capsys):
    good = tmp_path / "good.json"
    assert main(["profile", "--synthetic", "1x1x4090", "--out", str(good)]) == 0
    capsys.readouterr()
    malformed = tmp_path / "malformed.json"
    malformed.write_text('{"schema": "flashflex.cluster/1", "nodes": [')
    future = tmp_path / "future.json"
    future.write_text(json.dumps({**json.loads(good.read_text()), "schema": "flashflex.cluster/2"}))
    out = tmp_path / "out.json"
    cases = [
        ([str(good), str(tmp_path / "missing.json")], "no such file"),
        ([str(good), str(malformed)], "malformed JSON"),
        ([str(good), str(future)], "unknown schema"),
        ([str(good), str(good)], "node0"),  # node name collision
    ]
    for files, needle in cases:
        code = main(["profile", "merge", *files, "--out", str(out)])
        _assert_one_line_error(code, capsys, needle)
        assert not out.exists()


def test_usage_errors_exit_2(tmp_path, capsys):
    _assert_one_line_error(main(["profile", "--synthetic", "1x1x4090"]), capsys, "--out")
    code = main(["profile", "--synthetic", "1x1x4090", "--distributed", "--out", str(tmp_path / "x.json")])
    _assert_one_line_error(code, capsys, "cannot be combined")
    code = main(["profile", "--distributed", "--quick", "--out", str(tmp_path / "x.json")])
    _assert_one_line_error(code, capsys, "torchrun")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_no_file(tmp_path, capsys, monkeypatch):
    import os

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    assert main(["profile", "--synthetic", "1x1x4090", "--out", str(tmp_path / "c.json")]) == 2
    assert capsys.readouterr().err == f"error: cannot write {tmp_path / 'c.json'}: disk full\n"
    assert list(tmp_path.iterdir()) == []


def test_real_command_prints_no_traceback(tmp_path):
    out = tmp_path / "c.json"
    result = subprocess.run([FLASHFLEX, "profile", "--synthetic", "2x8xH100-SMX", "--out", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert re.fullmatch(r"error: unknown device type 'H100-SMX'; did you mean .*H100-SXM.*\n", result.stderr)
    assert not out.exists()

"""Cluster schema: addressing, link precedence, validation, stable I/O."""

from __future__ import annotations

import json

import pytest

from flashflex_cli.errors import InputError
from flashflex_cli.hardware.cluster import InterNode, NodePair, is_catalogued, load_cluster, save_cluster
from flashflex_cli.hardware.links import INTRA_LINKS, NIC_LINKS
from flashflex_cli.hardware.synthetic import build_cluster

MIXED = "1x2xA100-80G-SXM:nic=ib:bw=200:name=ib,1x2xA100-80G-SXM:nic=roce:bw=100:name=roce,2x2x4090:nic=eth:bw=25"


def test_device_ids_and_lookup():
    cluster = build_cluster(MIXED)
    assert cluster.device_ids == ["ib0/0", "ib0/1", "roce0/0", "roce0/1", "node0/0", "node0/1", "node1/0", "node1/1"]
    assert cluster.device("node1/1").type == "RTX-4090"
    assert cluster.node_of("roce0/1") == "roce0"
    for bad in ("node9/0", "node0/2", "node0", "node0/x"):
        with pytest.raises(InputError, match="unknown device"):
            cluster.device(bad)


def test_links_follow_fabric_classes():
    cluster = build_cluster(MIXED)
    assert cluster.link("ib0/0", "ib0/0").bandwidth == float("inf")
    assert cluster.link("ib0/0", "ib0/1").bandwidth == INTRA_LINKS["nvlink"].bandwidth
    assert cluster.link("node0/0", "node0/1").bandwidth == INTRA_LINKS["pcie"].bandwidth
    # InfiniBand and RoCE cannot talk RDMA to each other: Ethernet class (Holmes)
    ib_roce = cluster.link("ib0/0", "roce0/0")
    assert ib_roce.kind == "eth" and ib_roce.bandwidth == NIC_LINKS["eth"].bandwidth
    # like NICs: the slower end's configured bandwidth, 25 Gbit/s = 3.125e9 bytes/s
    assert cluster.link("node0/0", "node1/1").bandwidth == pytest.approx(25e9 / 8)


def test_measured_pair_beats_classes_and_defaults():
    cluster = build_cluster("3x1x4090:nic=eth")
    assert cluster.link("node0/0", "node1/0").bandwidth == NIC_LINKS["eth"].bandwidth
    measured = cluster.model_copy(update={"inter_node": InterNode(
        default_bandwidth=5e8, pairs=[NodePair(a="node1", b="node0", bandwidth=1.2e8, latency_s=1e-4)])})
    link = measured.link("node0/0", "node1/0")
    assert (link.bandwidth, link.latency_s, link.kind) == (1.2e8, 1e-4, "measured")
    assert measured.link("node0/0", "node2/0").bandwidth == 5e8
    assert link.transfer_time(1.2e8) == pytest.approx(1.0 + 1e-4)


def test_slowdown_divides_flops_and_a_dtype_the_device_lacks_runs_at_fp32():
    cluster = build_cluster("1x2xcpu:slowdown=1,4,1x1xV100-16G")
    assert cluster.device("node0/1").flops("fp32") == pytest.approx(cluster.device("node0/0").flops("fp32") / 4)
    v100 = cluster.device("node1/0")
    # V100 has fp16 tensor cores and no bf16 ones: bf16 matmuls run on its fp32 units, not at 125 TFLOP/s
    assert v100.flops("fp16") == pytest.approx(125e12)
    assert v100.flops("bf16") == pytest.approx(15.7e12) and v100.compute_dtype("bf16") == "fp32"
    assert v100.flops("tf32") == pytest.approx(15.7e12)


def test_save_load_round_trip_is_byte_stable(tmp_path):
    cluster = build_cluster(MIXED, name="mixed", description="test")
    path = tmp_path / "c.json"
    save_cluster(path, cluster)
    text = path.read_text()
    loaded = load_cluster(path)
    assert loaded == cluster and loaded.sha256() == cluster.sha256()
    save_cluster(path, loaded)
    assert path.read_text() == text and text.endswith("\n")
    assert list(json.loads(text))[:3] == ["schema", "name", "description"]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(schema="flashflex.cluster/9"), "unknown schema"),
        (lambda d: d["nodes"].append(dict(d["nodes"][0])), "duplicate node names"),
        (lambda d: d["nodes"][0]["devices"][0]["peak_flops"].update(bf16=float("inf")), "peak_flops"),
        (lambda d: d["nodes"][0]["devices"][0].update(memory_bandwidth=float("nan")), "memory_bandwidth"),
        (lambda d: d["nodes"][0]["devices"][0].update(memory_bytes=-1), "memory_bytes"),
        (lambda d: d["nodes"][0].update(nic="wifi"), "nic"),
        (lambda d: d["inter_node"].update(pairs=[{"a": "node0", "b": "ghost", "bandwidth": 1e9}]), "ghost"),
        (lambda d: d["nodes"][0].update(colour="red"), "colour"),
    ],
)
def test_invalid_files_give_one_line_input_errors(tmp_path, mutate, message):
    data = json.loads(build_cluster("1x2x4090").to_json())
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError) as info:
        load_cluster(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("source", ["catalog", "measured"])
def test_uncatalogued_device_type_with_its_peaks_is_accepted(tmp_path, source):
    data = json.loads(build_cluster("1x1x4090").to_json())
    data["nodes"][0]["devices"][0].update(type="Some-Future-GPU", source=source)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    assert load_cluster(path).device("node0/0").type == "Some-Future-GPU"
    assert not is_catalogued("Some-Future-GPU") and is_catalogued("4090")


def _future_gpu_cluster(tmp_path, drop: str | None = None):
    """A cluster file of two devices of a type the catalog does not know, with a 4090's figures (less `drop`)."""
    data = json.loads(build_cluster("1x2x4090").to_json())
    for device in data["nodes"][0]["devices"]:
        device["type"] = "Some-Future-GPU"
        if drop == "peak_flops":
            device["peak_flops"] = {}
        elif drop is not None:
            del device[drop]
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    return path


def test_an_uncatalogued_type_with_all_its_figures_is_planned_with_a_warning(tmp_path, capsys):
    from flashflex_cli.cli import main

    path = _future_gpu_cluster(tmp_path)
    assert {d.numbers_source for d in load_cluster(path).nodes[0].devices} == {"cluster file"}  # not "catalog"
    assert build_cluster("1x1x4090").device("node0/0").numbers_source == "catalog"
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--model", "llama-tiny", "--global-batch", "8", "--seq-len", "128",
                 "--no-baseline", "--out", str(out)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "Some-Future-GPU" in line]
    assert warnings == [f"warning: {path}: device type 'Some-Future-GPU' (2 devices) is not in the catalog: its peak "
                        "FLOP/s, memory and memory bandwidth are the cluster file's (source: cluster file), costed "
                        "with the default efficiency curve (give a layer profile to measure them)"]
    assert main(["show", str(out), "--cluster", str(path)]) == 0
    assert capsys.readouterr().err.count("not in the catalog") == 1


@pytest.mark.parametrize("drop", ["peak_flops", "memory_bytes", "memory_bandwidth"])
def test_an_uncatalogued_type_without_all_its_figures_is_refused_by_name(tmp_path, capsys, drop):
    from flashflex_cli.cli import main

    path, out = _future_gpu_cluster(tmp_path, drop), tmp_path / "plan.json"
    assert main(["plan", str(path), "--model", "llama-tiny", "--global-batch", "8", "--seq-len", "128",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: nodes.0.devices.0: device type "
                                                    "'Some-Future-GPU' is not in the catalog"), err
    assert f"it lacks {drop}" in err and "Traceback" not in err and not out.exists()


def test_an_rdma_node_reaches_a_slow_ethernet_node_at_that_nodes_speed() -> None:
    """InfiniBand to Ethernet falls back to Ethernet: the Ethernet class, or the Ethernet end's own slower NIC."""
    slow = build_cluster("1x8xA100-80G-SXM:nic=ib,1x8xRTX-3090:nic=eth:bw=1")
    assert slow.node_link("node0", "node1").bandwidth == pytest.approx(1e9 / 8)
    plain = build_cluster("1x8xA100-80G-SXM:nic=ib:bw=400,1x8xRTX-3090:nic=eth")
    assert plain.node_link("node0", "node1").bandwidth == NIC_LINKS["eth"].bandwidth

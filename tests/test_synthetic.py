"""Synthetic cluster specs: parsing, defaults, options, and one-line errors for bad specs."""

from __future__ import annotations

import pytest

from flashflex_cli.errors import InputError
from flashflex_cli.hardware.catalog import device_type
from flashflex_cli.hardware.synthetic import NodeGroup, build_cluster, parse_spec


def test_parse_example_spec():
    groups = parse_spec("1x8xA100-80G-SXM:nic=ib,3x8x4090:nic=eth")
    assert groups == [
        NodeGroup(1, 8, "A100-80G-SXM", "ib", None, (1.0,) * 8, None, None),
        NodeGroup(3, 8, "RTX-4090", "eth", None, (1.0,) * 8, None, None),
    ]


def test_bw_is_gigabits_per_second_stored_as_bytes_per_second():
    cluster = build_cluster("2x8xH100:nic=ib:bw=400,1x4xL40S:bw=25")
    assert cluster.nodes[0].nic_bandwidth == pytest.approx(50e9)
    assert cluster.nodes[2].nic_bandwidth == pytest.approx(3.125e9)
    assert cluster.nodes[2].nic == "eth"


def test_devices_take_catalog_figures():
    cluster = build_cluster("1x2xMI300X")
    device, kind = cluster.device("node0/1"), device_type("MI300X")
    assert (device.type, device.memory_bytes, device.memory_bandwidth) == (kind.name, kind.memory_bytes,
                                                                           kind.memory_bandwidth)
    assert device.peak_flops == kind.peak_flops and device.source == "catalog"
    assert cluster.nodes[0].intra_link.kind == "xgmi"


def test_intra_link_defaults_and_override():
    cluster = build_cluster("1x8xA100-80G-SXM,1x8xA100-80G-PCIe,1x2xcpu,1x8x4090:link=nvlink")
    assert [n.intra_link.kind for n in cluster.nodes] == ["nvlink", "pcie", "shm", "nvlink"]


def test_slowdown_list_and_single_value():
    cluster = build_cluster("1x4xcpu:slowdown=1,1,2,4,2x2xcpu:slowdown=3")
    assert [d.slowdown for d in cluster.nodes[0].devices] == [1, 1, 2, 4]
    assert [d.slowdown for n in cluster.nodes[1:] for d in n.devices] == [3, 3, 3, 3]
    # a slowdown list followed by more groups, options after the list
    cluster = build_cluster("1x2xcpu:slowdown=1,2:nic=roce,1x1x4090")
    assert cluster.nodes[0].nic == "roce" and len(cluster.nodes) == 2


def test_node_names_count_across_the_spec_and_prefixes():
    cluster = build_cluster("2x1x4090,1x1xA100:name=big,1x1x3090")
    assert [n.name for n in cluster.nodes] == ["node0", "node1", "big0", "node2"]


def test_whitespace_and_case_are_tolerated():
    cluster = build_cluster(" 1 X 2 x a100 : NIC=ib , 1x1xcpu")
    assert cluster.nodes[0].nic == "ib" and cluster.device("node0/0").type == "A100-80G-SXM"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty"),
        ("1x8", "malformed spec group"),
        ("2x8xA100,", "malformed spec group"),
        ("axbxA100", "malformed spec group"),
        ("1x8xA100:nic=wifi", "nic must be one of"),
        ("1x8xA100:bw=fast", "positive number"),
        ("1x8xA100:bw=0", "positive"),
        ("1x8xA100:colour=red", "unknown option"),
        ("1x8xA100:nic", "unknown option"),
        ("1x8xA100:nic=ib:nic=eth", "given twice"),
        ("1x4xcpu:slowdown=1,2", "2 values for 4 devices"),
        ("1x2xcpu:slowdown=1,-2", "malformed spec group"),
        ("1x2xcpu:slowdown=0", "positive"),
        ("0x8xA100", "node count must be an integer in [1, 65536]"),
        ("1x0xA100", "devices per node must be an integer in [1, 1024]"),
        ("1x8xA100:link=carrier-pigeon", "link must be one of"),
        ("1x8xA100:name=a/b", "name prefix"),
        ("1x1xA100:name=x,1x1x4090:name=x", "same name"),
        ("1x8xA100-80", "did you mean"),
    ],
)
def test_bad_specs_raise_one_line_input_errors(spec, message):
    with pytest.raises(InputError) as info:
        build_cluster(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value)

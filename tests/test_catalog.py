"""Device catalog: coverage, dense figures, lookups, and the docs table that cites every entry."""

from __future__ import annotations

import re

import pytest

from flashflex_cli.errors import InputError
from flashflex_cli.hardware.catalog import CATALOG, GIB, device_type

REQUIRED = [
    "V100-16G", "T4", "A10", "A30", "A40", "RTX-A6000", "RTX-3080Ti", "RTX-3090", "RTX-4090", "L4", "L40",
    "L40S", "A100-40G-PCIe", "A100-80G-PCIe", "A100-40G-SXM", "A100-80G-SXM", "H100-PCIe", "H100-SXM", "H200",
    "B200", "MI250X", "MI300X", "cpu",
]


def test_catalog_covers_the_required_types():
    assert len(CATALOG) >= 20
    for name in REQUIRED:
        assert device_type(name).name == name


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        # dense figures: the datasheets' starred 2:4-sparse figures are twice these
        ("A100-80G-SXM", "bf16", 312.0),
        ("H100-SXM", "bf16", 989.4),
        ("H100-PCIe", "bf16", 756.0),
        ("L40S", "bf16", 362.05),
        ("L4", "fp16", 121.0),
        ("MI300X", "bf16", 1307.4),
        # GeForce: FP32-accumulate tensor rate, half the FP16-accumulate marketing figure
        ("RTX-4090", "bf16", 165.2),
        ("RTX-3090", "fp16", 71.0),
        ("RTX-3080Ti", "bf16", 68.2),
    ],
)
def test_dense_peak_figures(name, dtype, tflops):
    assert device_type(name).peak_flops[dtype] == pytest.approx(tflops * 1e12)


def test_memory_figures():
    assert device_type("A100-80G-SXM").memory_bytes == 80 * GIB
    assert device_type("A100-80G-SXM").memory_bandwidth == pytest.approx(2039e9)
    assert device_type("A100-80G-PCIe").memory_bandwidth == pytest.approx(1935e9)
    assert device_type("H200").memory_bytes == 141 * 10**9
    assert device_type("RTX-3080Ti").memory_bytes == 12 * GIB


def test_every_entry_is_consistent():
    for entry in CATALOG.values():
        assert entry.memory_bytes > 0 and entry.memory_bandwidth > 0, entry.name
        assert "fp32" in entry.peak_flops, entry.name
        assert all(v > 0 for v in entry.peak_flops.values()), entry.name
        if entry.name != "cpu":
            # half precision is never slower than fp32 on an accelerator with a fast path for it
            for dtype in ("fp16", "bf16"):
                if dtype in entry.peak_flops:
                    assert entry.peak_flops[dtype] >= entry.peak_flops["fp32"], (entry.name, dtype)
        assert entry.default_intra_link in ("nvlink", "pcie", "xgmi", "shm")


def test_lookup_by_alias_is_case_insensitive():
    assert device_type("4090").name == "RTX-4090"
    assert device_type(" a100 ").name == "A100-80G-SXM"
    assert device_type("H100").name == "H100-SXM"


def test_unknown_type_suggests_closest_names():
    with pytest.raises(InputError) as info:
        device_type("A100-80")
    message = str(info.value)
    assert "A100-80G-SXM" in message and "\n" not in message
    with pytest.raises(InputError, match="RTX-4090"):
        device_type("rtx4080")


def test_docs_table_lists_every_entry_with_its_figures_and_a_source(repo):
    text = (repo / "docs" / "devices.md").read_text()
    assert "dense" in text.lower() and "accumulate" in text.lower()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    for entry in CATALOG.values():
        assert entry.name in rows, f"docs/devices.md has no row for {entry.name}"
        cells = [c.strip() for c in rows[entry.name].split("|")[1:-1]]
        assert cells[3] == f"{entry.memory_bandwidth / 1e9:g}", entry.name
        for column, dtype in zip(cells[4:8], ("fp32", "tf32", "fp16", "bf16"), strict=True):
            value = entry.peak_flops.get(dtype)
            assert column == ("-" if value is None else f"{value / 1e12:g}"), (entry.name, dtype)
        if entry.name != "cpu":
            assert re.search(r"https://\S+", cells[-1]), f"no source URL for {entry.name}"

"""The limits of physical_limits.py, the host-name rule of hostnames.py and the byte sizes of units.py: what they
accept, what they refuse, and that every real device, link class and default sits inside them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from flashflex_cli.cost.params import LIMITS, CostParams
from flashflex_cli.errors import InputError
from flashflex_cli.hardware.catalog import CATALOG
from flashflex_cli.hardware.cluster import load_cluster
from flashflex_cli.hardware.links import INTRA_LINKS, NIC_LINKS
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.hostnames import host_problem
from flashflex_cli.physical_limits import (
    DEVICE_MEMORY_BYTES,
    HELD_BYTES,
    LATENCY_S,
    LINK_BANDWIDTH,
    SLOWDOWN,
    shown,
)
from flashflex_cli.units import byte_size

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("nbytes", "text"), [
    (0, "0 B"), (1000, "1000 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"), (3_744_768, "3.57 MiB"),
    (80 * 2**30, "80.0 GiB"), (2**40 * 1.25, "1.25 TiB"), (2**50, "1.00 PiB"), (-2048, "-2.00 KiB"),
])
def test_byte_size_picks_the_unit_that_shows_the_figure(nbytes: float, text: str) -> None:
    assert byte_size(nbytes) == text


@pytest.mark.parametrize(("value", "problem"), [
    (True, "must be a number, got True"),
    ("4096", "must be a number, got '4096'"),
    (None, "must be a number, got None"),
    (math.nan, "must be a finite number, got nan"),
    (-math.inf, "must be a finite number, got -inf"),
    (10**400, "got an integer of 401 digits"),
    (10**40, "got an integer of 41 digits"),
    (1e40, "got 1e+40"),
    (2**20 + 0.5, "must be a whole number of bytes"),
    (-0.0, "got -0"),
])
def test_a_limit_refuses_what_no_device_has(value: object, problem: str) -> None:
    found = DEVICE_MEMORY_BYTES.problem(value)
    assert found is not None and problem in found, found


def test_a_limit_keeps_values_inside_it() -> None:
    assert DEVICE_MEMORY_BYTES.check(80 * 2**30, "memory") == 80 * 2**30
    assert DEVICE_MEMORY_BYTES.check(8e10, "memory") == 80_000_000_000  # a whole float is a whole number
    assert isinstance(DEVICE_MEMORY_BYTES.check(8e10, "memory"), int)
    assert math.copysign(1.0, HELD_BYTES.check(-0.0, "reserve")) == 1.0  # -0 is stored as 0
    assert SLOWDOWN.check(1, "slowdown") == 1.0
    with pytest.raises(InputError, match=r"^slowdown must be in \[1, 10000\], got 1e\+308$"):
        SLOWDOWN.check(1e308, "slowdown")


def test_shown_never_converts_a_huge_integer() -> None:
    assert shown(10**5000) == "an integer of more than 4000 digits"
    assert shown("x" * 100).endswith("...") and len(shown("x" * 100)) == 60


@pytest.mark.parametrize("host", ["node-1", "gpu-2.example.org", "gpu-2.example.org.", "a" * 63, "10.0.0.1",
                                  "::1", "2001:db8::8a2e:370:7334", "fe80::1%eth0", "3com.net"])
def test_host_names_and_addresses_are_accepted(host: str) -> None:
    assert host_problem(host) is None


@pytest.mark.parametrize("host", ["a;rm -rf x", "a b", "-x", "x-", "a..b", "", ".", "a" * 64, "10.0.0.256",
                                  "1.2.3", "12345", "::1::2", "fe80::1%a;b", "10.0.0.1%eth0", "my_host",
                                  "$(id)", "a'b", ".".join(["abcdefgh"] * 30)])
def test_what_cannot_name_a_host_is_refused(host: str) -> None:
    assert host_problem(host) is not None


def test_a_recorded_hostname_may_hold_underscores() -> None:
    assert host_problem("my_host", underscores=True) is None
    assert host_problem("my host", underscores=True) is not None


def test_every_cost_parameter_number_has_a_limit() -> None:
    """A number CostParams adds must get its physical limit here (from_overrides refuses by it)."""
    numeric = {f.name for f in dataclasses.fields(CostParams) if f.type in ("float", "Mapping[str, float]")}
    assert numeric and numeric <= set(LIMITS), sorted(numeric - set(LIMITS))
    defaults = CostParams()
    for name in numeric - {"compute_efficiency", "compute_intercept"}:
        assert LIMITS[name].problem(getattr(defaults, name)) is None, name


def test_every_catalog_device_and_link_class_is_inside_the_limits() -> None:
    for name in CATALOG:
        build_cluster(f"1x2x{name}")  # validated like a file
    for link in (*INTRA_LINKS.values(), *NIC_LINKS.values()):
        assert LINK_BANDWIDTH.problem(link.bandwidth) is None and LATENCY_S.problem(link.latency_s) is None


def test_bundled_cluster_files_load() -> None:
    for path in sorted((ROOT / "profiles").glob("*.json")):
        load_cluster(path)

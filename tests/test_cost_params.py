"""CostParams: defaults from the reference data, overrides, validation."""

from __future__ import annotations

import pytest

from flashflex_cli.cost.params import CostParams
from flashflex_cli.cost.reference_efficiency import REFERENCE_EFFICIENCY
from flashflex_cli.errors import InputError


def test_defaults_come_from_reference_table() -> None:
    params = CostParams()
    assert params.efficiency("A100-80G-SXM", "bf16") == REFERENCE_EFFICIENCY["A100-80G-SXM:fp16"][0]
    assert params.efficiency("A100-80G-SXM", "fp16") == REFERENCE_EFFICIENCY["A100-80G-SXM:fp16"][0]
    assert params.efficiency("T4", "fp32") == REFERENCE_EFFICIENCY["T4:fp32"][0]
    # a type the measurements do not cover falls back to the median of the fp16 entries
    assert params.efficiency("RTX-4090", "bf16") == params.default_compute_efficiency
    assert 0.3 < params.default_compute_efficiency < 0.7
    assert params.efficiency("RTX-4090", "bf16", measured=True) == params.measured_compute_efficiency


def test_every_default_factor_is_a_sane_fraction() -> None:
    params = CostParams()
    for value in params.compute_efficiency.values():
        assert 0.1 < value <= 1.0
    assert params.dp_overlap_fraction == 0.0  # the runtime reduces after the backward


def test_overrides_apply_and_merge() -> None:
    params = CostParams.from_overrides({"tp_comm_efficiency": 0.5, "compute_efficiency": {"a100": 0.4},
                                        "master_weights": False})
    assert params.tp_comm_efficiency == 0.5
    assert params.master_weights is False
    assert params.efficiency("A100-80G-SXM", "bf16") == 0.4  # alias canonicalised, both dtypes set
    assert params.efficiency("A100-80G-SXM", "fp32") == 0.4
    assert params.efficiency("T4", "fp16") == CostParams().efficiency("T4", "fp16")  # others kept
    typed = CostParams.from_overrides({"compute_efficiency": {"my-gpu:fp32": 0.9}})
    assert typed.efficiency("my-gpu", "fp32") == 0.9
    assert typed.efficiency("my-gpu", "bf16") == typed.default_compute_efficiency


@pytest.mark.parametrize("overrides, message", [
    ({"fudge_factor": 1.8}, "unknown name 'fudge_factor'"),
    ({"tp_comm_efficiency": 1.5}, r"\[0.0001, 1\], got 1.5"),
    ({"tp_comm_efficiency": 1e-300}, r"\[0.0001, 1\], got 1e-300"),
    ({"tp_comm_efficiency": -0.0}, r"\[0.0001, 1\], got -0"),
    ({"memory_reserve_bytes": 10**400}, "an integer of 401 digits"),
    ({"memory_reserve_bytes": True}, "must be a number, got True"),
    ({"optimizer_bytes_per_param": 1e300}, r"\[0 B, 1.00 KiB\], got 1e\+300"),
    ({"loss_passes": 1e300}, r"\[0, 1000\]"),
    ({"compute_intercept": {"A100": 1e300}}, r"compute_intercept\[A100\] must be in \[0, 10000\]"),
    ({"memory_fragmentation": 1.0}, r"\[0, 1\)"),
    ({"dp_overlap_fraction": -0.1}, r"\[0, 1\)"),
    ({"memory_reserve_bytes": "lots"}, "must be a number"),
    ({"master_weights": 1}, "true or false"),
    ({"compute_efficiency": {"A100": 2.0}}, r"\[0.0001, 1\]"),
    ({"compute_efficiency": {"A100:int8": 0.5}}, "dtype"),
    ({"compute_efficiency": 0.5}, "object"),
])
def test_bad_overrides_are_input_errors(overrides, message) -> None:
    with pytest.raises(InputError, match=message):
        CostParams.from_overrides(overrides)


def test_params_are_hashable_and_compare_by_value() -> None:
    a = CostParams.from_overrides({"p2p_efficiency": 0.9})
    b = CostParams.from_overrides({"p2p_efficiency": 0.9})
    assert a == b and hash(a) == hash(b)
    assert a != CostParams()


def test_reference_table_is_up_to_date_with_its_source() -> None:
    """The generated table equals what scripts/derive_efficiency.py derives from the shared data."""
    import importlib.util
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    source = repo.parent / "shared" / "data" / "layer-latencies-cephalo.json"
    if not source.exists():
        pytest.skip("../shared/data is not beside this checkout")
    spec = importlib.util.spec_from_file_location("derive_efficiency", repo / "scripts" / "derive_efficiency.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table, points = module.derive(json.loads(source.read_text()))
    assert table == REFERENCE_EFFICIENCY
    from flashflex_cli.cost.reference_efficiency import MEASURED_POINTS

    assert tuple(points) == MEASURED_POINTS

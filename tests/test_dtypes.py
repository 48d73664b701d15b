"""What each device computes natively, and what a dtype it lacks costs: the catalog, cluster files, the local
probe, the cost model's rates, the stage marks in estimates and plans, `show`, and layer profiles that
exclude their TP collectives (`tp_comm_included`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from flashflex_cli.cost.comm import allreduce_time
from flashflex_cli.cost.compute import layer_times
from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.params import CostParams
from flashflex_cli.cost.reference_efficiency import REFERENCE_EFFICIENCY
from flashflex_cli.cost.view import view
from flashflex_cli.errors import InputError
from flashflex_cli.hardware.catalog import CATALOG, device_type
from flashflex_cli.hardware.cluster import Cluster, load_cluster
from flashflex_cli.hardware.probe_local import (
    DeviceProbe,
    NodeProbe,
    native_dtypes_for_capability,
    node_from_probe,
)
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.layers.schema import LayerProfile, ModelShape
from flashflex_cli.model.flops import layer_input_bytes
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.render import render_plan
from flashflex_cli.plan.schema import Plan, TrainConfig

from .cost_fixtures import cluster, plan, stage

GIB = 1024**3
SMALL = PRESETS["llama-small"]
BF16 = TrainConfig(global_batch=4, seq_len=128, dtype="bf16")

# The generations as the vendors describe them (docs/devices.md cites the sources).
AMPERE_AND_LATER = ["A10", "A10G", "A30", "A40", "RTX-A6000", "RTX-3080Ti", "RTX-3090", "RTX-4090", "L4", "L40",
                    "L40S", "A100-40G-PCIe", "A100-80G-PCIe", "A100-40G-SXM", "A100-80G-SXM", "H100-PCIe",
                    "H100-NVL", "H100-SXM", "H200", "B200", "MI300X"]


@pytest.mark.parametrize("name", AMPERE_AND_LATER)
def test_ampere_and_later_compute_bf16_tf32_and_fp16_natively(name: str) -> None:
    assert set(device_type(name).native_dtypes) == {"fp32", "tf32", "fp16", "bf16"}


@pytest.mark.parametrize(("name", "native"), [
    ("V100-16G", {"fp32", "fp16"}), ("V100-32G", {"fp32", "fp16"}), ("T4", {"fp32", "fp16"}),  # fp16 tensor cores
    ("P100", {"fp32"}), ("P40", {"fp32"}),  # Pascal: no tensor cores
    ("MI250X", {"fp32", "fp16", "bf16"}),  # CDNA2 matrix cores: fp16, bf16, no tf32
])
def test_older_generations_lack_bf16_and_tf32(name: str, native: set[str]) -> None:
    assert set(device_type(name).native_dtypes) == native


def test_every_catalog_entry_states_fp32_and_only_known_dtypes() -> None:
    for entry in CATALOG.values():
        assert "fp32" in entry.native_dtypes and set(entry.native_dtypes) <= {"fp32", "tf32", "fp16", "bf16"}
        assert set(entry.native_dtypes) - {"fp32"} <= set(entry.peak_flops), entry.name  # a native dtype has a peak


def test_docs_table_lists_each_types_native_dtypes(repo: Path) -> None:
    lines = [line for line in (repo / "docs" / "devices.md").read_text().splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].split("|")]
    column = header.index("native")
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.split("|")] for line in lines[2:])}
    for entry in CATALOG.values():
        assert set(rows[entry.name][column].split(", ")) == set(entry.native_dtypes), entry.name


# ---- cluster files -------------------------------------------------------------------------------------
def test_a_device_without_the_field_takes_the_catalogs_list_and_the_file_keeps_its_bytes() -> None:
    c = build_cluster("1x1xV100-16G,1x1xA100-80G-SXM")
    assert "native_dtypes" not in c.to_json()  # older files and new catalog devices read and write alike
    v100, a100 = c.device("node0/0"), c.device("node1/0")
    assert v100.native() == {"fp32", "fp16"} and a100.native() == {"fp32", "tf32", "fp16", "bf16"}
    assert (v100.compute_dtype("bf16"), v100.compute_dtype("fp16")) == ("fp32", "fp16")


def test_a_devices_own_list_overrides_the_catalog_and_round_trips(tmp_path: Path) -> None:
    data = json.loads(build_cluster("1x1xA100-80G-SXM").to_json())
    data["nodes"][0]["devices"][0]["native_dtypes"] = ["fp16"]  # e.g. a part with bf16 fused off
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    dev = load_cluster(path).device("node0/0")
    assert dev.native() == {"fp32", "fp16"} and dev.flops("bf16") == pytest.approx(19.5e12)
    assert json.loads(load_cluster(path).to_json())["nodes"][0]["devices"][0]["native_dtypes"] == ["fp16"]


def test_an_unknown_dtype_in_the_list_is_refused_by_name(tmp_path: Path) -> None:
    data = json.loads(build_cluster("1x1xA100-80G-SXM").to_json())
    data["nodes"][0]["devices"][0]["native_dtypes"] = ["int8"]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InputError, match="native_dtypes"):
        load_cluster(path)


def test_an_uncatalogued_type_is_native_in_the_dtypes_its_file_gives_peaks_for() -> None:
    mystery = {"type": "Mystery", "memory_bytes": 16 * GIB, "peak_flops": {"fp32": 10e12, "fp16": 80e12},
               "memory_bandwidth": 5e11}
    c = Cluster.model_validate({"nodes": [{"name": "n", "devices": [mystery]}]})
    dev = c.device("n/0")
    assert dev.flops("fp16") == 80e12 and dev.flops("bf16") == 10e12  # no bf16 figure: not native, fp32 rate
    only16 = {**mystery, "peak_flops": {"fp16": 80e12}}
    c = Cluster.model_validate({"nodes": [{"name": "n", "devices": [only16]}]})
    with pytest.raises(InputError, match="no fp32 figure"):
        c.device("n/0").flops("bf16")


def test_a_non_native_figure_in_the_file_never_beats_the_fp32_peak() -> None:
    c = build_cluster("1x1xP100")  # the datasheet's 18.7 TFLOP/s fp16 is fp16-accumulate half2 arithmetic
    assert c.device("node0/0").flops("fp16") == pytest.approx(9.3e12)


# ---- the local probe -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("capability", "native"), [
    ((6, 0), ("fp32",)), ((6, 1), ("fp32",)), ((7, 0), ("fp32", "fp16")), ((7, 5), ("fp32", "fp16")),
    ((8, 0), ("fp32", "tf32", "fp16", "bf16")), ((8, 9), ("fp32", "tf32", "fp16", "bf16")),
    ((9, 0), ("fp32", "tf32", "fp16", "bf16")), ((10, 0), ("fp32", "tf32", "fp16", "bf16")),
])
def test_native_dtypes_follow_the_compute_capability(capability: tuple[int, int], native: tuple[str, ...]) -> None:
    assert native_dtypes_for_capability(*capability) == native


def test_a_measured_gpu_keeps_what_its_probe_found() -> None:
    probe = NodeProbe("host", "cuda", [DeviceProbe(0, "Tesla V100-SXM2-16GB", "bf16", 1.4e13, 16 * GIB, 8e11,
                                                   ("fp32", "fp16")),
                                       DeviceProbe(1, "Mystery GPU", "bf16", 1.0e14, 16 * GIB, 5e11,
                                                   ("fp32", "tf32", "fp16", "bf16"))])
    node = node_from_probe(probe)
    v100, mystery = node.devices
    assert v100.type == "V100-16G" and v100.native_dtypes == ("fp32", "fp16")
    assert mystery.native_dtypes == ("fp32", "tf32", "fp16", "bf16") and mystery.compute_dtype("bf16") == "bf16"
    c = Cluster.model_validate({"nodes": [node.model_dump()]})
    # the measured bf16 matmul rate is what a bf16 matmul really runs at there: it is used as it is
    assert view(c).rate("host/0", "bf16", CostParams()) == pytest.approx(1.4e13 * CostParams().measured_compute_efficiency)


# ---- the cost model ------------------------------------------------------------------------------------
def test_a_dtype_the_device_lacks_runs_at_its_fp32_peak_and_fp32_efficiency() -> None:
    c = cluster(("V100-16G", 1, "ib", "nvlink"), ("A100-80G-SXM", 1, "ib", "nvlink"), ("T4", 1, "eth", "pcie"))
    cv, params = view(c), CostParams()
    eff = {key: value[0] for key, value in REFERENCE_EFFICIENCY.items()}
    assert cv.rate("node0/0", "bf16", params) == pytest.approx(15.7e12 * eff["V100-16G:fp32"])
    assert cv.rate("node0/0", "fp16", params) == pytest.approx(125e12 * eff["V100-16G:fp16"])  # fp16 peak, fp16 class
    assert cv.rate("node1/0", "bf16", params) == pytest.approx(312e12 * eff["A100-80G-SXM:fp16"])
    assert cv.rate("node2/0", "bf16", params) == pytest.approx(8.1e12 * eff["T4:fp32"])
    assert cv.rate("node2/0", "fp16", params) == pytest.approx(65e12 * eff["T4:fp16"])
    # so a compute-bound bf16 layer on a V100 takes several times its fp16 time (5.6x at the slope)
    bf16 = TrainConfig(global_batch=4, seq_len=2048, dtype="bf16")
    v100_bf16 = layer_times(c, ["node0/0"], PRESETS["llama2-7b"], bf16, params, micro_batch_size=4)
    v100_fp16 = layer_times(c, ["node0/0"], PRESETS["llama2-7b"], bf16.model_copy(update={"dtype": "fp16"}), params,
                            micro_batch_size=4)
    assert v100_bf16.layer_s > 4 * v100_fp16.layer_s


def _profile(device_type_: str, dtype: str, seconds: float, tps: tuple[int, ...] = (1,), **over: object) -> LayerProfile:
    def part(t: float) -> dict:
        return {"fwd_s": t, "bwd_s": 2 * t, "activation_bytes": 1e6}

    return LayerProfile.model_validate({
        "device_type": device_type_, "model": ModelShape.of(SMALL).model_dump(exclude_none=True), "seq_len": 128,
        "dtype": dtype, "attention": "sdpa",
        # measured on the paths a run takes by default there: compiled on GPUs, eager on CPU, the chunked loss
        "runtime": {"compile": device_type_ != "cpu", "chunked_loss": True},
        "entries": [{"micro_batch_size": 1, "tp": tp, "layer": part(seconds / tp), "embedding": part(1e-5),
                     "head": part(seconds / tp)} for tp in tps], **over})


def test_a_profile_measured_in_the_dtype_on_that_device_wins() -> None:
    c = cluster(("V100-16G", 1, "ib", "nvlink"))
    params = CostParams().with_layer_profiles((_profile("V100-16G", "bf16", 0.004),))
    lt = layer_times(c, ["node0/0"], SMALL, BF16, params, micro_batch_size=1)
    assert lt.source == "measured" and (lt.fwd_s, lt.bwd_s) == pytest.approx((0.004, 0.008))


def test_estimate_marks_stages_whose_devices_lack_the_dtype_and_old_plans_load() -> None:
    c = cluster(("A100-80G-SXM", 1, "ib", "nvlink"), ("V100-16G", 1, "ib", "nvlink"))
    p = plan(c, SMALL, BF16, [(4, [stage(["node0/0"], 0, 4), stage(["node1/0"], 4, 8)])])
    est = estimate(p, c)
    assert [s.not_native_on for s in est.stages] == [(), ("V100-16G",)]
    stages = est.to_predicted()["stages"]
    assert "dtype_not_native_on" not in stages[0] and stages[1]["dtype_not_native_on"] == ["V100-16G"]
    fp16 = estimate(plan(c, SMALL, BF16.model_copy(update={"dtype": "fp16"}),
                         [(4, [stage(["node0/0"], 0, 4), stage(["node1/0"], 4, 8)])]), c)
    assert all(not s.not_native_on for s in fp16.stages)
    data = json.loads(p.model_copy(update={"predicted": est.to_predicted()}).to_json())
    assert Plan.model_validate(data).predicted["stages"][1]["dtype_not_native_on"] == ["V100-16G"]
    del data["predicted"]["stages"][1]["dtype_not_native_on"]  # a plan written before the field existed
    Plan.model_validate(data)
    data["predicted"]["stages"][1]["dtype_not_native_on"] = "V100-16G"
    with pytest.raises(ValueError, match="dtype_not_native_on must be a list"):
        Plan.model_validate(data)


def test_show_marks_such_stages_and_says_why() -> None:
    c = cluster(("A100-80G-SXM", 1, "ib", "nvlink"), ("V100-16G", 1, "ib", "nvlink"))
    p = plan(c, SMALL, BF16, [(4, [stage(["node0/0"], 0, 4), stage(["node1/0"], 4, 8)])])
    p = p.model_copy(update={"predicted": estimate(p, c).to_predicted()})
    console = Console(record=True, width=200)
    render_plan(console, p)
    text = console.export_text()
    assert "no bf16" in text
    assert "1 stage computes bf16 on V100-16G, which lacks it (no bf16 tensor cores): costed at no more than " \
           "their fp32 rate" in text


# ---- tp_comm_included ----------------------------------------------------------------------------------
def test_tp_comm_included_is_written_only_when_false() -> None:
    with_comm = _profile("cpu", "bf16", 0.01, (1, 2))
    assert "tp_comm_included" not in with_comm.to_json()  # older profiles keep their text and sha256
    explicit = LayerProfile.model_validate({**json.loads(with_comm.to_json()), "tp_comm_included": True})
    assert explicit.sha256() == with_comm.sha256()
    without = _profile("cpu", "bf16", 0.01, (1, 2), tp_comm_included=False)
    assert json.loads(without.to_json())["tp_comm_included"] is False and without.sha256() != with_comm.sha256()


def test_a_profile_without_tp_collectives_costs_a_tp2_stage_the_modelled_collectives_more() -> None:
    c = build_cluster("1x2xcpu")
    devices = ["node0/0", "node0/1"]
    included = CostParams().with_layer_profiles((_profile("cpu", "bf16", 0.01, (1, 2)),))
    excluded = CostParams().with_layer_profiles((_profile("cpu", "bf16", 0.01, (1, 2), tp_comm_included=False),))
    a = layer_times(c, devices, SMALL, BF16, included, micro_batch_size=1)
    b = layer_times(c, devices, SMALL, BF16, excluded, micro_batch_size=1)
    ar = allreduce_time(c, devices, layer_input_bytes(SMALL, 1, 128, "bf16"), included)
    assert ar > 0 and a.source == b.source == "measured"
    assert (b.fwd_s - a.fwd_s, b.bwd_s - a.bwd_s) == pytest.approx((2 * ar, 2 * ar))  # two all-reduces each way
    assert (b.embed_fwd_s - a.embed_fwd_s, b.head_bwd_s - a.head_bwd_s) == pytest.approx((ar, ar))
    assert (a.tp_fwd_s, b.tp_fwd_s, b.tp_bwd_s) == pytest.approx((0.0, 2 * ar, 2 * ar))
    p = plan(c, SMALL, BF16, [(4, [stage(devices, 0, SMALL.num_layers)])])
    ea, eb = estimate(p, c, included).stages[0], estimate(p, c, excluded).stages[0]
    layers = SMALL.num_layers
    assert eb.fwd_s - ea.fwd_s == pytest.approx(layers * 2 * ar + ar)  # layers + the embedding's all-reduce
    assert eb.bwd_s - ea.bwd_s == pytest.approx(layers * 2 * ar + ar)  # layers + the head's input gradient
    assert eb.tp_comm_s == pytest.approx(layers * 4 * ar) and ea.tp_comm_s == 0.0

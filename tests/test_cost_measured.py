"""Measured layer profiles in the cost model: matching, interpolation and extrapolation, and their use by
estimate, `plan`, `show` and `diff`; the analytic fallback's fixes (a + b * mbs, tf32, eager attention memory,
fewer micro-batches than stages, uncatalogued device types)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashflex_cli.cli import main
from flashflex_cli.cost.comm import allreduce_time
from flashflex_cli.cost.compute import layer_times
from flashflex_cli.cost.estimate import estimate
from flashflex_cli.cost.measured import find_profile, read_profile
from flashflex_cli.cost.memory import stage_memory
from flashflex_cli.cost.params import CostParams
from flashflex_cli.hardware.synthetic import build_cluster
from flashflex_cli.layers.schema import LayerProfile, ModelShape, save_layer_profile
from flashflex_cli.model.flops import layer_input_bytes
from flashflex_cli.model.spec import PRESETS
from flashflex_cli.plan.schema import TrainConfig, load_plan

from .cost_fixtures import cluster, plan, stage

MODEL = PRESETS["llama-small"]
TRAIN = TrainConfig(global_batch=8, seq_len=128, dtype="fp32", attention="sdpa")


def part(fwd: float, bwd: float, act: float = 0.0) -> dict:
    return {"fwd_s": fwd, "bwd_s": bwd, "activation_bytes": act}


def profile(entries: list[tuple[int, int, float]], device_type: str = "cpu", fixed: float | None = 1e8,
            **over) -> LayerProfile:
    """A profile whose layer takes `t` seconds forward and 2t backward at each (mbs, tp, t)."""
    data = {"schema": "flashflex.layers/1", "device_type": device_type,
            "model": ModelShape.of(MODEL).model_dump(), "seq_len": 128, "dtype": "fp32", "attention": "sdpa",
            "runtime": {"compile": False, "chunked_loss": True},  # what a CPU or GPU run takes by default

            "entries": [{"micro_batch_size": m, "tp": tp, "layer": part(t, 2 * t, 1e6 * m / tp),
                         "embedding": part(1e-4, 1e-4), "head": part(t, 2 * t, 5e6 * m),
                         **({"fixed_bytes": fixed} if fixed is not None else {})}
                        for m, tp, t in entries], **over}
    return LayerProfile.model_validate(data)


def test_profile_matches_only_the_same_shape_settings_and_runtime_paths() -> None:
    prof = profile([(1, 1, 0.01)])
    assert find_profile([prof], "cpu", MODEL, TRAIN, chunked_loss=True) is prof
    assert find_profile([prof], "CPU", MODEL, TRAIN, chunked_loss=True) is prof
    assert find_profile([prof], "A100-80G-SXM", MODEL, TRAIN, chunked_loss=True) is None
    assert find_profile([prof], "cpu", PRESETS["llama-tiny"], TRAIN, chunked_loss=True) is None
    for other in ({"seq_len": 256}, {"dtype": "bf16"}, {"attention": "eager"}, {"recompute": True}):
        assert find_profile([prof], "cpu", MODEL, TRAIN.model_copy(update=other), chunked_loss=True) is None, other
    # measured on other paths: compiled, or with the whole-vocabulary loss (what a profile without paths means)
    assert find_profile([prof], "cpu", MODEL, TRAIN, compile_=True, chunked_loss=True) is None
    assert find_profile([prof], "cpu", MODEL, TRAIN, chunked_loss=False) is None
    legacy = LayerProfile.model_validate({**json.loads(prof.to_json()), "runtime": None})
    assert find_profile([legacy], "cpu", MODEL, TRAIN) is legacy


def test_interpolates_between_and_extrapolates_beyond_measured_points() -> None:
    prof = profile([(1, 1, 0.010), (4, 1, 0.025), (1, 2, 0.006)])
    inside = read_profile(prof, 2, 1)
    assert inside.layer.fwd_s == pytest.approx(0.015) and not inside.extrapolated
    assert inside.layer.activation_bytes == pytest.approx(2e6)
    beyond = read_profile(prof, 8, 1)  # the line a + b * mbs through (1, 0.010), (4, 0.025): 0.005 + 0.005 mbs
    assert beyond.layer.fwd_s == pytest.approx(0.045) and beyond.extrapolated
    wider = read_profile(prof, 1, 4)  # beyond the measured TP degrees: nearest (tp 2) scaled by 2/4
    assert wider.layer.fwd_s == pytest.approx(0.003) and wider.extrapolated
    between = read_profile(profile([(1, 1, 0.010), (1, 4, 0.004)]), 1, 2)  # linear in 1/tp
    assert between.layer.fwd_s == pytest.approx(0.004 + (0.010 - 0.004) * (0.5 - 0.25) / (1 - 0.25))


def test_measured_stage_uses_the_profile_times_slowdown_and_adds_no_tp_comm() -> None:
    c = build_cluster("1x4xcpu:slowdown=1,1,2,2")
    prof = profile([(1, 1, 0.010), (1, 2, 0.006)])
    params = CostParams(layer_profiles=(prof,))
    fast = layer_times(c, ["node0/0"], MODEL, TRAIN, params, micro_batch_size=1)
    slow = layer_times(c, ["node0/2"], MODEL, TRAIN, params, micro_batch_size=1)
    pair = layer_times(c, ["node0/0", "node0/2"], MODEL, TRAIN, params, micro_batch_size=1)
    assert fast.source == "measured" and (fast.fwd_s, fast.bwd_s) == pytest.approx((0.010, 0.020))
    assert slow.fwd_s == pytest.approx(0.020)  # slowdown 2
    # the slower device of the TP pair sets the pace: its compute (TP 1 time / 2) is stretched, the
    # collectives (what TP 2 adds to a perfect split: 0.006 - 0.010 / 2) are not
    assert pair.fwd_s == pytest.approx(0.010 / 2 * 2 + (0.006 - 0.010 / 2)) and pair.tp_fwd_s == 0.0
    alone = CostParams(layer_profiles=(profile([(1, 2, 0.006)]),))  # no TP 1 entry: modelled all-reduces
    ar = allreduce_time(c, ["node0/0", "node0/2"], layer_input_bytes(MODEL, 1, 128, "fp32"), alone)
    paired = layer_times(c, ["node0/0", "node0/2"], MODEL, TRAIN, alone, micro_batch_size=1)
    assert paired.fwd_s == pytest.approx((0.006 - 2 * ar) * 2 + 2 * ar)
    assert layer_times(c, ["node0/0"], MODEL, TRAIN, CostParams(), micro_batch_size=1).source == "modelled"


def test_estimate_and_memory_follow_the_profile() -> None:
    c = build_cluster("1x2xcpu")
    prof = profile([(1, 1, 0.010), (2, 1, 0.016)], fixed=1.5e8)
    p = plan(c, MODEL, TRAIN, [(4, [stage(["node0/0"], 0, 2), stage(["node0/1"], 2, MODEL.num_layers)])], mbs=2)
    est = estimate(p, c, CostParams(layer_profiles=(prof,)))
    assert [s.source for s in est.stages] == ["measured", "measured"]
    assert est.profiles_used() == [prof.sha256()]
    first = est.stages[0]
    assert first.fwd_s == pytest.approx(2 * 0.016 + 1e-4)  # 2 layers + embedding at mbs 2
    assert first.memory.fixed == 1.5e8  # the measured fixed bytes, allocated beside the model
    held_send = 2 * 128 * MODEL.hidden_size * 4  # the first forward's fp32 send, waited for at the step's end
    assert first.memory.activations == pytest.approx(2 * 2 * 2e6 + held_send)  # 2 in flight x 2 layers x 2e6 B
    second = est.stages[1].memory  # the last stage: its input (a measured layer counts its output) and head
    assert second.activations == pytest.approx((MODEL.num_layers - 2) * 2e6 + 2 * 5e6 + held_send)
    predicted = est.to_predicted()["stages"][0]
    assert predicted["source"] == "measured" and set(predicted["memory"]) >= {"weights", "activations", "fixed"}
    assert {"tp_comm_s", "dp_exposed_s", "optimizer_s", "end_s"} <= set(predicted)


def test_compute_time_has_an_intercept_so_larger_micro_batches_are_cheaper_per_sequence() -> None:
    c = cluster(("A100-80G-SXM", 1, "ib", "nvlink"))
    model = PRESETS["llama2-7b"]
    one = layer_times(c, ["node0/0"], model, TrainConfig(global_batch=8, seq_len=1024),
                      CostParams(), micro_batch_size=1)
    eight = layer_times(c, ["node0/0"], model, TrainConfig(global_batch=8, seq_len=1024),
                        CostParams(), micro_batch_size=8)
    assert one.layer_s > eight.layer_s / 8  # per sequence, micro-batch 1 pays the fixed part 8 times


def test_tf32_uses_the_tensor_core_peak() -> None:
    c = cluster(("A100-80G-SXM", 1, "ib", "nvlink"))
    fp32 = layer_times(c, ["node0/0"], MODEL, TRAIN.model_copy(update={"dtype": "fp32"}), CostParams(), micro_batch_size=1)
    tf32 = layer_times(c, ["node0/0"], MODEL, TRAIN.model_copy(update={"dtype": "tf32"}), CostParams(), micro_batch_size=1)
    assert tf32.layer_s < fp32.layer_s


def test_eager_attention_keeps_the_score_matrix() -> None:
    import dataclasses

    from flashflex_cli.cost import activations as A
    from flashflex_cli.semantics.runtime_paths import RuntimeOptions

    eager_layers = dataclasses.replace(CostParams(), runtime=RuntimeOptions(compile=False))
    args = (MODEL, 1, 1, False, False, 1, eager_layers)
    sdpa = stage_memory(args[0], TRAIN, *args[1:], micro_batch_size=1)
    eager = stage_memory(args[0], TRAIN.model_copy(update={"attention": "eager"}), *args[1:], micro_batch_size=1)
    # fp32: the probabilities [b, heads, s, s] (4 bytes each) and copies of q, k, v and the output instead of
    # SDPA's log-sum-exp
    p = A.PartShape(MODEL, 1, 1, TRAIN.seq_len, "fp32", "eager", on_cuda=True)
    scores = MODEL.num_heads * TRAIN.seq_len**2 * 4
    per_layer = A.attention_saved_bytes(p) - A.attention_saved_bytes(p.__class__(**{**p.__dict__, "attention": "sdpa"}))
    assert per_layer == scores - MODEL.num_heads * TRAIN.seq_len * 4
    assert eager.activations - sdpa.activations == pytest.approx(per_layer)


def test_fewer_micro_batches_than_stages_is_estimated() -> None:
    c = build_cluster("1x3xcpu")
    p = plan(c, MODEL, TRAIN, [(1, [stage(["node0/0"], 0, 1), stage(["node0/1"], 1, 2),
                                    stage(["node0/2"], 2, MODEL.num_layers)])], mbs=8)
    est = estimate(p, c)
    assert est.iteration_time_s > 0 and est.pipelines[0].bubble_fraction > 0.5


def test_uncatalogued_device_type_uses_the_default_curve() -> None:
    c = cluster(("A100-80G-SXM", 1, "ib", "nvlink"))
    data = json.loads(c.to_json())
    data["nodes"][0]["devices"][0]["type"] = "Future-GPU"
    data["nodes"][0]["devices"][0]["source"] = "measured"  # datasheet peaks given in the file: not a matmul rate
    from flashflex_cli.hardware.cluster import Cluster

    future = Cluster.model_validate(data)
    params = CostParams()
    lt = layer_times(future, ["node0/0"], MODEL, TrainConfig(global_batch=8, seq_len=128), params, micro_batch_size=1)
    want = params.default_compute_efficiency
    rate = future.device("node0/0").flops("bf16") * want
    flops = 2 * 128 * (2 * 4 * MODEL.hidden_size**2 + 3 * MODEL.hidden_size * MODEL.intermediate_size)
    assert params.efficiency("Future-GPU", "bf16") == want
    assert lt.fwd_s - lt.tp_fwd_s >= 0.5 * flops / rate  # the default curve, not measured_compute_efficiency


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    cluster_path = tmp_path / "c.json"
    assert main(["profile", "--synthetic", "1x2xcpu", "--out", str(cluster_path)]) == 0
    prof_path = tmp_path / "cpu.layers.json"
    save_layer_profile(prof_path, profile([(1, 1, 0.004), (2, 1, 0.007)]))
    return {"cluster": cluster_path, "layers": prof_path, "dir": tmp_path}


PLAN = ["--model", "llama-small", "--global-batch", "8", "--seq-len", "128", "--dtype", "fp32", "--no-baseline"]


def test_plan_show_and_diff_take_layer_profiles(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    modelled, measured = files["dir"] / "a.json", files["dir"] / "b.json"
    assert main(["plan", str(files["cluster"]), *PLAN, "--out", str(modelled)]) == 0
    assert main(["plan", str(files["cluster"]), *PLAN, "--layers", str(files["layers"]), "--out", str(measured)]) == 0
    sha = LayerProfile.model_validate_json(files["layers"].read_text()).sha256()
    assert load_plan(modelled).inputs.layer_profiles is None
    assert load_plan(measured).inputs.layer_profiles == [sha]
    assert all(s["source"].startswith("measured") for s in load_plan(measured).predicted["stages"])
    capsys.readouterr()
    assert main(["show", str(measured), "--cluster", str(files["cluster"]), "--layers", str(files["layers"])]) == 0
    out = capsys.readouterr().out
    assert "measured" in out and sha[:12] in out
    assert main(["show", str(measured), "--cluster", str(files["cluster"])]) == 0
    assert "every stage modelled" in capsys.readouterr().out
    assert main(["diff", str(modelled), str(measured), "--json"]) == 0
    assert f"layer profile {sha[:12]}: now used" in json.loads(capsys.readouterr().out)["changes"]


def test_a_profile_measured_on_other_runtime_paths_is_named_and_left_out(files: dict[str, Path],
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(files["layers"].read_text())
    del data["runtime"]  # measured eager with the whole-vocabulary loss; the default launch chunks the loss
    files["layers"].write_text(json.dumps(data))
    out = files["dir"] / "p.json"
    capsys.readouterr()
    assert main(["plan", str(files["cluster"]), *PLAN, "--layers", str(files["layers"]), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "layer profile of cpu (eager, whole-vocabulary loss) matched no stage" in " ".join(err.split())
    assert load_plan(out).inputs.layer_profiles is None
    assert main(["show", str(out), "--cluster", str(files["cluster"]), "--layers", str(files["layers"])]) == 0
    assert "matched no stage" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(schema="flashflex.layers/2"),
    lambda d: d.update(dtype="int8"),
    lambda d: d["entries"][0]["layer"].update(fwd_s=-1),
    lambda d: d["entries"].append(dict(d["entries"][0])),
    lambda d: d.update(colour="red"),
])
def test_bad_layer_profile_is_one_line_exit_2_and_writes_nothing(files: dict[str, Path], mutate,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(files["layers"].read_text())
    mutate(data)
    bad = files["dir"] / "bad.layers.json"
    bad.write_text(json.dumps(data))
    out = files["dir"] / "never.json"
    assert main(["plan", str(files["cluster"]), *PLAN, "--layers", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and not out.exists()


def test_two_profiles_for_the_same_thing_are_refused(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    twin = files["dir"] / "twin.json"
    save_layer_profile(twin, profile([(1, 1, 0.005)]))
    assert main(["plan", str(files["cluster"]), *PLAN, "--layers", str(files["layers"]), "--layers", str(twin)]) == 2
    assert "describes the same" in capsys.readouterr().err


def test_stages_reduced_across_pipelines_hold_a_gradient_buffer() -> None:
    """A stage with DP partners packs its gradients into flat fp32 copies while they are reduced: every
    gradient and its copy beside the parameters and moments, a moment no stage without partners has."""
    c = build_cluster("1x3xcpu")
    p = plan(c, MODEL, TRAIN, [(4, [stage(["node0/0"], 0, MODEL.num_layers)]),
                               (4, [stage(["node0/1"], 0, 4), stage(["node0/2"], 4, MODEL.num_layers)])], mbs=1)
    one = plan(c, MODEL, TRAIN.model_copy(update={"global_batch": 4}),
               [(4, [stage(["node0/0"], 0, MODEL.num_layers)])], mbs=1)
    reduced = estimate(p, c).stages[0].memory
    alone = estimate(one, c).stages[0].memory
    assert alone.dp_buffers == 0.0 and alone.phase != "data-parallel reduction"
    assert reduced.phase == "data-parallel reduction"
    assert reduced.dp_buffers == pytest.approx(CostParams().dp_buffer_factor * reduced.grads)
    assert reduced.allocated == pytest.approx(reduced.weights + 2 * reduced.grads + reduced.optimizer)


def test_profile_slowdown_marks_probed_cpu_devices_as_emulated(tmp_path: Path) -> None:
    out = tmp_path / "slow.json"
    assert main(["profile", "--quick", "--slowdown", "3", "--out", str(out)]) == 0
    from flashflex_cli.hardware.cluster import load_cluster

    assert {d.slowdown for d in load_cluster(out).nodes[0].devices} == {3.0}
    assert main(["profile", "--quick", "--slowdown", "0.5", "--out", str(tmp_path / "bad.json")]) == 2
    assert not (tmp_path / "bad.json").exists()


def test_a_profile_for_another_shape_or_setting_is_refused(files: dict[str, Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = files["dir"] / "never.json"
    for args, word in ((["--seq-len", "256"], "seq_len"), (["--attention", "eager"], "attention")):
        argv = ["plan", str(files["cluster"]), *PLAN, "--layers", str(files["layers"]), "--out", str(out)]
        assert main([*argv, *args]) == 2  # a repeated option: the last value counts
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and word in err and str(files["layers"]) in err and not out.exists()
    other = files["dir"] / "tiny.layers.json"
    tiny = profile([(1, 1, 0.001)]).model_copy(update={"model": ModelShape.of(PRESETS["llama-tiny"])})
    save_layer_profile(other, tiny)
    assert main(["plan", str(files["cluster"]), *PLAN, "--layers", str(other)]) == 2
    assert "model shape" in capsys.readouterr().err


def test_diff_predicts_both_plans_afresh_with_profiles(files: dict[str, Path],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    a = files["dir"] / "a.json"
    assert main(["plan", str(files["cluster"]), *PLAN, "--out", str(a)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a), str(a), "--cluster", str(files["cluster"]), "--layers", str(files["layers"]),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"]  # both sides predicted the same way
    assert main(["diff", str(a), str(a), "--layers", str(files["layers"])]) == 2
    assert "need --cluster" in capsys.readouterr().err


def test_a_llama_profile_does_not_describe_a_qwen2_or_windowed_model_of_the_same_widths() -> None:
    """Biases and a sliding window change a layer's cost, so they are part of the shape a profile matches."""
    from flashflex_cli.layers.schema import ModelShape
    from flashflex_cli.model.spec import PRESETS

    llama = PRESETS["llama-tiny"]
    qwen = llama.model_copy(update={"family": "qwen2", "attention_bias": True})
    mistral = llama.model_copy(update={"family": "mistral", "sliding_window": 16})
    shapes = {ModelShape.of(m) for m in (llama, qwen, mistral)}
    assert len(shapes) == 3
    plain = ModelShape.of(llama).model_dump(exclude_none=True)
    assert set(plain) == {"hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"}

"""Proof of issue 9's communication work, measured: each improvement on and off, on emulated CPU clusters whose
hosts are network namespaces joined by links shaped to 1 Gbit/s (tests/infra/netns.py; recipe in
/work/shared/recipes/netns-cluster.md).

Three experiments, each launched twice through `flashflex launch --launcher torchrun` (one torchrun per namespace
host), once with the improvement and once with its switch (`--no-lean-p2p`, `--no-overlap-dp`,
`--no-hierarchical-dp`); every figure is the median over the steps after the warm-up of the per-step figures in
the run's metrics.jsonl:
  (a) one pipeline of two TP-2 stages, one stage per host, the boundary across the shaped link: pipeline-transfer
      time per step (p2p_s summed over both stages; it includes waiting for the neighbour), lean transfers on/off.
      Target: -40%. The model is narrow (hidden 32, one layer per stage, vocabulary 16) and the micro-batches big
      (512 x 32 tokens: a 2 MiB fp32 activation), because at hidden 64 a CPU core spends 3-5 times longer on a layer's
      forward and backward than 1 Gbit/s takes to carry its activation (measured here), and transfers shorter
      than the compute are hidden by the kernel's socket buffers (lean transfers then save nothing measurable). Slowdown 1: no prediction is
      checked here, and the four ranks share the two cores.
  (b) two single-stage pipelines on two hosts, the data-parallel reduction across the shaped link: exposed DP
      time (the largest stage's dp_s: from the end of the schedule until the sums are back) and step time,
      overlapped reduction on/off; the step-time change is compared with the cost model's prediction for the same
      plan on a cluster file measured across the same hosts (`flashflex profile --distributed`), its compute
      calibrated by the "off" run (`flashflex calibrate`). Targets: exposed DP -50%; step change within 15% of
      the predicted one.
  (c) six single-device pipelines on three hosts, 2 per host, every link shaped: every slice's holders span the
      3 hosts with 2 holders on each; overlap off in both runs so dp_s is the whole reduction; hierarchical
      reduction on/off: the ratio of reduction times, hierarchical / flat, beside the cost model's for a cluster
      file measured across the hosts; the hierarchical run's parts too: the leaders' all-reduce across the hosts
      (dp_across_s) and the rest (reduce and broadcast inside each host) against the model's parts.
Beside each run: wall time, CPU time of all its processes (user + system) and the 1-minute load average before
and after (the host is shared: other load slows the emulated devices down).

Run (root, for the namespaces): .venv/bin/python benchmarks/bench_runtime_comm.py [--quick] [--only a,b,c]
[--steps N] [--work DIR]. Exit code 1 when a run fails (targets missed are reported, not an error).
Last line: `bench_runtime_comm: p2p -X%, exposed dp -Y%, step -Z% (predicted -W%), hierarchical/flat R`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/infra/netns.py, benchmarks/commands.py

from benchmarks.commands import CommandFailed, run, run_all, usage  # noqa: E402

from flashflex_cli.model.hf_config import resolve_model  # noqa: E402
from flashflex_cli.model.spec import ModelSpec  # noqa: E402

BIN = Path(sys.executable).parent
FLASHFLEX = str(BIN / "flashflex")
PREFIX = "ffB"  # namespace names: ffB<pid>h<i>, ffB<pid>br
RATE = "1gbit"
SWITCH_FLAGS = {"lean_p2p": "--no-lean-p2p", "overlap_dp": "--no-overlap-dp",
                "hierarchical_dp": "--no-hierarchical-dp"}
RUN_TIMEOUT_S = 600.0
Device = tuple[int, int]  # (host index, device index on that host)


class BenchError(CommandFailed):
    """A run or a setup step failed: the benchmark exits 1 with this message (as with a failed command)."""


@dataclass(frozen=True)
class Pipeline:
    """One pipeline: micro-batch size (sequences), micro-batches, stages as (devices, (first layer, end))."""

    mbs: int
    micro: int
    stages: tuple[tuple[tuple[Device, ...], tuple[int, int]], ...]


@dataclass(frozen=True)
class Experiment:
    """One comparison: `hosts` namespace hosts of `per_host` emulated devices (slowdown each), every host's link
    shaped; the plan; the switch compared (`switch`) and switches off in both runs (`always_off`)."""

    key: str
    title: str
    hosts: int
    per_host: int
    slowdown: float
    model: ModelSpec
    seq_len: int
    pipelines: tuple[Pipeline, ...]
    switch: str
    always_off: tuple[str, ...] = ()
    measured_links: bool = False  # cluster file from `flashflex profile --distributed` (predictions need it)

    @property
    def global_batch(self) -> int:
        """Sequences per step."""
        return sum(p.mbs * p.micro for p in self.pipelines)


@dataclass(frozen=True)
class Figures:
    """Medians over the steps after the warm-up (seconds), and the launch's wall / CPU seconds and load."""

    step_s: float
    p2p_s: float
    dp_s: float
    p2p_stages: tuple[float, ...] = ()  # per stage (pipelines, then stages), medians
    across_s: float = 0.0  # hierarchical reductions' cross-node step, the slowest stage (leaders; CPU runs)
    wall_s: float = 0.0
    cpu_s: float = 0.0
    load_before: float = 0.0
    load_after: float = 0.0


# ---- plans and figures (pure) -------------------------------------------------------------------------------
def narrow_model(hidden: int, ffn: int, heads: int = 4, layers: int = 2, vocab: int = 16) -> ModelSpec:
    """A shallow Llama with a small MLP and vocabulary: little compute per byte of activation sent between
    stages (compute per token grows with hidden^2 and the vocabulary, the activation with hidden)."""
    return ModelSpec(name=f"narrow-{hidden}", hidden_size=hidden, num_layers=layers, num_heads=heads,
                     num_kv_heads=heads, intermediate_size=ffn, vocab_size=vocab)


def experiments(quick: bool) -> dict[str, Experiment]:
    """The three experiments; `quick`: tiny sizes for a smoke run of the harness (figures meaningless)."""
    small = resolve_model("llama-tiny" if quick else "llama-small")
    whole = (0, small.num_layers)
    a_model = narrow_model(32, 32)
    a_mbs, a_micro, a_seq = (64, 4, 32) if quick else (512, 16, 32)
    boundary = ((((0, 0), (0, 1)), (0, 1)), (((1, 0), (1, 1)), (1, 2)))  # stage 0 on host 0, stage 1 on host 1
    return {
        "a": Experiment("a", "TP2 -> TP2 boundary across the shaped link", 2, 2, 1.0, a_model, a_seq,
                        (Pipeline(a_mbs, a_micro, boundary),), "lean_p2p"),
        "b": Experiment("b", "two pipelines on two hosts, DP across the shaped link", 2, 1, 2.0, small,
                        32 if quick else 64, tuple(Pipeline(1 if quick else 5, 1, ((((h, 0),), whole),))
                                                   for h in range(2)),
                        "overlap_dp", measured_links=True),
        "c": Experiment("c", "holders on 3 hosts, 2 per host (6 single-device pipelines)", 3, 2, 4.0, small, 32,
                        tuple(Pipeline(1, 1, ((((h, d),), whole),)) for h in range(3) for d in range(2)),
                        "hierarchical_dp", always_off=("overlap_dp",), measured_links=True),
    }


def plan_data(exp: Experiment, node_names: list[str], cluster_sha256: str, cluster_name: str) -> dict[str, Any]:
    """The plan of `exp` as a flashflex.plan/1 dict, its devices named after the cluster's nodes."""
    def name(device: Device) -> str:
        return f"{node_names[device[0]]}/{device[1]}"

    train = {"global_batch": exp.global_batch, "seq_len": exp.seq_len, "dtype": "fp32", "attention": "sdpa"}
    data: dict[str, Any] = {
        "schema": "flashflex.plan/1",
        "inputs": {"cluster_sha256": cluster_sha256, "cluster_name": cluster_name,
                   "model": exp.model.model_dump(mode="json"), "train": train, "strategy": "manual"},
        "pipelines": [{"micro_batch_size": p.mbs, "num_micro_batches": p.micro,
                       "stages": [{"devices": [name(d) for d in devs], "tp": len(devs), "layers": list(span)}
                                  for devs, span in p.stages]} for p in exp.pipelines]}
    used = {name(d) for p in exp.pipelines for devs, _ in p.stages for d in devs}
    every = [f"{node}/{i}" for node in node_names for i in range(exp.per_host)]
    data["unused_devices"] = [{"device": d, "reason": "not in this experiment"} for d in every if d not in used]
    return data


def switch_flags(exp: Experiment, on: bool) -> list[str]:
    """`flashflex launch` flags of one run: the compared switch off unless `on`, plus `always_off`."""
    off = [*exp.always_off, *(() if on else (exp.switch,))]
    return [SWITCH_FLAGS[name] for name in SWITCH_FLAGS if name in off]


def figures(rows: list[dict[str, Any]], warmup: int) -> Figures:
    """Medians over the steps after `warmup` of: step_time_s; p2p_s summed over the stages (their TP rank 0);
    dp_s of the slowest stage (the exposed reduction); dp_across_s of the slowest stage (0 when absent)."""
    kept = rows[warmup:] or rows
    if not kept:
        raise BenchError("metrics.jsonl holds no step")
    return Figures(step_s=statistics.median(r["step_time_s"] for r in kept),
                   p2p_s=statistics.median(sum(s["p2p_s"] for s in r["stages"]) for r in kept),
                   dp_s=statistics.median(max(s["dp_s"] for s in r["stages"]) for r in kept),
                   p2p_stages=tuple(statistics.median(r["stages"][i]["p2p_s"] for r in kept)
                                    for i in range(len(kept[0]["stages"]))),
                   across_s=statistics.median(max(s.get("dp_across_s", 0.0) for s in r["stages"]) for r in kept))


def change_pct(before: float, after: float) -> float:
    """Relative change in percent (negative: fell); NaN when `before` is not positive."""
    return (after / before - 1.0) * 100.0 if before > 0 else math.nan


def within(measured: float, predicted: float, tolerance: float = 0.15) -> bool:
    """`measured` is within `tolerance` (relative) of a non-zero `predicted`."""
    return predicted != 0 and abs(measured - predicted) <= tolerance * abs(predicted)


def last_line(p2p: float, dp: float, step: float, predicted: float, ratio: float) -> str:
    """The benchmark's last line (changes in percent, signed; the ratio with two decimals)."""
    return (f"bench_runtime_comm: p2p {p2p:+.1f}%, exposed dp {dp:+.1f}%, step {step:+.1f}% "
            f"(predicted {predicted:+.1f}%), hierarchical/flat {ratio:.2f}")


# ---- running ------------------------------------------------------------------------------------------------
def synthetic_cluster(exp: Experiment, work: Path) -> Path:
    """A cluster file of `exp.hosts` nodes of emulated CPU devices (no probes: (a) and (c) compare two runs)."""
    path = work / f"cluster-{exp.key}.json"
    factors = ",".join(f"{exp.slowdown:g}" for _ in range(exp.per_host))
    run([FLASHFLEX, "profile", "--synthetic", f"{exp.hosts}x{exp.per_host}xcpu:slowdown={factors}:bw=1",
         "--out", str(path), "--name", f"bench-{exp.key}"])
    return path


def measured_cluster(net: Any, exp: Experiment, work: Path, port: int) -> Path:
    """`flashflex profile --distributed --quick` across the namespace hosts: measured devices and links."""
    path = work / f"cluster-{exp.key}.json"
    commands = []
    for i in range(exp.hosts):
        command = [*net.prefix_cmd(i), sys.executable, "-m", "torch.distributed.run",
                   *net.torchrun_args(i, port=port, rdzv_id=f"ffB-profile-{exp.key}"), "-m", "flashflex_cli.cli",
                   "profile", "--distributed", "--quick", "--node-name", f"h{i}", "--cpu-devices", str(exp.per_host),
                   "--slowdown", f"{exp.slowdown:g}", "--out", str(path)]
        commands.append((command, net.torchrun_env(i)))
    run_all(commands, 300)
    return path


def write_plan(exp: Experiment, cluster_path: Path, work: Path) -> Path:
    """Write and validate the experiment's plan for the cluster file."""
    from flashflex_cli.hardware.cluster import load_cluster
    from flashflex_cli.plan.schema import Plan, save_plan

    cluster = load_cluster(cluster_path)
    nodes = [node.name for node in cluster.nodes]
    if len(nodes) != exp.hosts:
        raise BenchError(f"{cluster_path}: {len(nodes)} nodes, experiment {exp.key} needs {exp.hosts}")
    path = work / f"plan-{exp.key}.json"
    save_plan(path, Plan.model_validate(plan_data(exp, nodes, cluster.sha256(), cluster.name)))
    return path


def launch(net: Any, plan: Path, cluster: Path, out: Path, steps: int, flags: list[str], run_id: str,
           port: int) -> dict[str, float]:
    """Render the plan's torchrun commands with `flashflex launch` (with `flags`), run line i in namespace host i;
    wall and CPU seconds, load before and after."""
    rendered = run([FLASHFLEX, "launch", str(plan), "--cluster", str(cluster), "--steps", str(steps),
                    "--out", str(out), "--launcher", "torchrun", "--hosts", ",".join(h.addr for h in net.hosts),
                    "--ifname", ",".join(h.ifname for h in net.hosts), "--run-id", run_id, "--port", str(port),
                    "--timeout", "120", "--torchrun", str(BIN / "torchrun"), "--overwrite", "--no-checkpoint", *flags])
    lines = [x for x in rendered.stdout.splitlines() if x.strip() and not x.startswith("#")]
    if len(lines) != len(net.hosts):
        raise BenchError(f"flashflex launch rendered {len(lines)} command lines for {len(net.hosts)} hosts")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with usage() as figures:
        run_all([([*net.prefix_cmd(i), "bash", "-c", line], env) for i, line in enumerate(lines)], RUN_TIMEOUT_S)
    return figures


def read_rows(out: Path) -> list[dict[str, Any]]:
    """The rows of a finished run's metrics.jsonl."""
    path = out / "metrics.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: {exc}") from None


def run_experiment(exp: Experiment, steps: int, warmup: int, work: Path,
                   ports: list[int]) -> tuple[dict[bool, Figures], Path, Path]:
    """Both runs of `exp` on fresh namespace hosts; ({on: figures}, plan path, cluster path)."""
    from tests.infra.netns import NetnsHosts

    def port() -> int:
        ports[0] += 1
        return ports[0]

    results: dict[bool, Figures] = {}
    with NetnsHosts(exp.hosts, shape={i: RATE for i in range(exp.hosts)}, prefix=PREFIX) as net:
        cluster = measured_cluster(net, exp, work, port()) if exp.measured_links else synthetic_cluster(exp, work)
        plan = write_plan(exp, cluster, work)
        for on in (False, True):  # the baseline first
            out = work / f"run-{exp.key}-{'on' if on else 'off'}"
            flags = switch_flags(exp, on)
            usage = launch(net, plan, cluster, out, steps, flags, f"ffB-{exp.key}-{int(on)}", port())
            fig = dataclasses.replace(figures(read_rows(out), warmup), **usage)
            results[on] = fig
            stages = "+".join(f"{x * 1e3:.0f}" for x in fig.p2p_stages) if exp.key == "a" else ""
            print(f"({exp.key}) {exp.switch:15s} {'on ' if on else 'off'}: step {fig.step_s * 1e3:8.1f} ms, p2p "
                  f"{fig.p2p_s * 1e3:8.1f} ms{f' ({stages})' if stages else ''}, exposed dp {fig.dp_s * 1e3:8.1f} ms "
                  f"| wall {fig.wall_s:5.1f} s, "
                  f"CPU {fig.cpu_s:6.1f} s, load {fig.load_before:.2f}->{fig.load_after:.2f} | flags "
                  f"{' '.join(flags) or '-'}", flush=True)
    return results, plan, cluster


# ---- predictions ----------------------------------------------------------------------------------------------
def switched_params(base: Any, overlap: bool, hierarchical: bool) -> Any:
    """CostParams with the cost model's counterparts of `--no-overlap-dp` / `--no-hierarchical-dp` set."""
    names = {f.name for f in dataclasses.fields(base)}
    if not {"dp_overlap", "dp_hierarchical"} <= names:
        raise BenchError("the cost model has no dp_overlap / dp_hierarchical parameters (CostParams)")
    return dataclasses.replace(base, dp_overlap=overlap, dp_hierarchical=hierarchical)


def predict(plan_path: Path, cluster_path: Path, layers: Path | None, overlap: bool = True,
            hierarchical: bool = True) -> tuple[float, float]:
    """(iteration seconds, exposed DP seconds) the cost model predicts, with the layer profile when given."""
    from flashflex_cli.cost.estimate import estimate
    from flashflex_cli.cost.params import CostParams
    from flashflex_cli.hardware.cluster import load_cluster
    from flashflex_cli.layers.load import load_layer_profiles
    from flashflex_cli.plan.schema import load_plan

    params = CostParams()
    if layers is not None:
        params = params.with_layer_profiles(load_layer_profiles([layers]))
    est = estimate(load_plan(plan_path), load_cluster(cluster_path), switched_params(params, overlap, hierarchical))
    return est.iteration_time_s, est.dp_exposed_s


def predicted_dp_parts(plan_path: Path, cluster_path: Path) -> tuple[float, float]:
    """(intra-node, cross-node) seconds the cost model charges for the plan's hierarchical DP buckets, summed
    (cost.dp.dp_buckets without overlap: one bucket per holder set)."""
    from flashflex_cli.cost.dp import dp_buckets
    from flashflex_cli.cost.params import CostParams
    from flashflex_cli.hardware.cluster import load_cluster
    from flashflex_cli.plan.schema import load_plan

    buckets = dp_buckets(load_plan(plan_path), load_cluster(cluster_path), switched_params(CostParams(), False, True))
    return sum(b.inside_s for b in buckets), sum(b.across_s for b in buckets)


def predicted_transfer_s(plan_path: Path, cluster_path: Path, lean: bool) -> float:
    """The cost model's seconds for one micro-batch's activation across the first stage boundary."""
    from flashflex_cli.cost.comm import p2p_time
    from flashflex_cli.cost.params import CostParams
    from flashflex_cli.hardware.cluster import load_cluster
    from flashflex_cli.plan.schema import load_plan

    plan = load_plan(plan_path)
    pipe = plan.pipelines[0]
    return p2p_time(load_cluster(cluster_path), pipe.stages[0].devices, pipe.stages[1].devices, plan.inputs.model,
                    plan.inputs.train, CostParams(), micro_batch_size=pipe.micro_batch_size, lean=lean)


def calibrated_layers(run_dir: Path, work: Path) -> Path:
    """`flashflex calibrate RUN`: per-layer compute seconds fitted to the run's measured stage times."""
    path = work / "calibrated.layers.json"
    run([FLASHFLEX, "calibrate", str(run_dir), "--out", str(path)])
    return path


# ---- main -----------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 3 steps: a smoke run of the harness")
    parser.add_argument("--only", default="a,b,c", help="experiments to run, comma-separated (default a,b,c)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 7; quick 3)")
    parser.add_argument("--work", type=Path, default=None, help="keep files here (default: a temporary folder)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tests.infra.netns import netns_available

    ok, why = netns_available(PREFIX)
    if not ok:
        print(f"bench_runtime_comm: needs network namespaces: {why}", file=sys.stderr)
        return 1
    steps = args.steps or (3 if args.quick else 7)
    warmup = 1 if steps <= 3 else 2
    chosen = [k.strip() for k in args.only.split(",") if k.strip()]
    table = experiments(args.quick)
    if not chosen or any(k not in table for k in chosen):
        print(f"--only: choose among {', '.join(table)}", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-runtime-comm-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"host: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {steps} steps per run, median of the last "
          f"{steps - warmup}; links shaped to {RATE}; work folder {work}", flush=True)
    p2p = dp = step = predicted = ratio = math.nan
    ports = [29700]
    try:
        for key in chosen:
            exp = table[key]
            print(f"({key}) {exp.title}: {exp.hosts} hosts x {exp.per_host} devices (slowdown {exp.slowdown:g}), "
                  f"{exp.model.name} h={exp.model.hidden_size} L={exp.model.num_layers}, seq {exp.seq_len}, "
                  f"pipelines {[(p.mbs, p.micro) for p in exp.pipelines]} (mbs, micro-batches)", flush=True)
            res, plan, cluster = run_experiment(exp, steps, warmup, work, ports)
            off, on = res[False], res[True]
            if key == "a":
                p2p = change_pct(off.p2p_s, on.p2p_s)
                print(f"(a) p2p per step {off.p2p_s * 1e3:.1f} -> {on.p2p_s * 1e3:.1f} ms ({p2p:+.1f}%): target "
                      f"-40%: {'ok' if p2p <= -40 else 'MISSED'}; cost model, one activation across the boundary "
                      f"at 1 Gbit/s: {predicted_transfer_s(plan, cluster, False) * 1e3:.2f} -> "
                      f"{predicted_transfer_s(plan, cluster, True) * 1e3:.2f} ms", flush=True)
            elif key == "b":
                dp, step = change_pct(off.dp_s, on.dp_s), change_pct(off.step_s, on.step_s)
                layers = calibrated_layers(work / "run-b-off", work)
                pred_off, exposed_off = predict(plan, cluster, layers, overlap=False)
                pred_on, exposed_on = predict(plan, cluster, layers)
                predicted = change_pct(pred_off, pred_on)
                print(f"(b) exposed dp {off.dp_s * 1e3:.1f} -> {on.dp_s * 1e3:.1f} ms ({dp:+.1f}%): target -50%: "
                      f"{'ok' if dp <= -50 else 'MISSED'}", flush=True)
                print(f"(b) step {off.step_s * 1e3:.1f} -> {on.step_s * 1e3:.1f} ms ({step:+.1f}%); cost model "
                      f"(measured links, compute calibrated by the off run): {pred_off * 1e3:.1f} -> "
                      f"{pred_on * 1e3:.1f} ms ({predicted:+.1f}%), exposed dp {exposed_off * 1e3:.1f} -> "
                      f"{exposed_on * 1e3:.1f} ms; measured change within 15% of the predicted one: "
                      f"{'ok' if within(step, predicted) else 'MISSED'}", flush=True)
            else:
                ratio = on.dp_s / off.dp_s if off.dp_s > 0 else math.nan
                flat = predict(plan, cluster, None, overlap=False, hierarchical=False)[1]
                hier = predict(plan, cluster, None, overlap=False)[1]
                inside, across = predicted_dp_parts(plan, cluster)
                print(f"(c) DP reduction {off.dp_s * 1e3:.1f} ms flat, {on.dp_s * 1e3:.1f} ms hierarchical: "
                      f"ratio {ratio:.2f} (cost model, measured links: {flat * 1e3:.1f} / {hier * 1e3:.1f} ms, "
                      f"{hier / flat if flat > 0 else math.nan:.2f}); hierarchical parts: across nodes (leaders' "
                      f"all-reduce) {on.across_s * 1e3:.1f} ms, model {across * 1e3:.1f} ms; inside nodes (reduce "
                      f"+ broadcast, the rest) {(on.dp_s - on.across_s) * 1e3:.1f} ms, model {inside * 1e3:.1f} ms",
                      flush=True)
    except CommandFailed as exc:
        print(f"bench_runtime_comm: {exc}", file=sys.stderr, flush=True)
        return 1
    print(last_line(p2p, dp, step, predicted, ratio), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Validate the cost model against real runs: predicted vs measured iteration time and peak memory.

Launches distinct plans for real on emulated CPU clusters (1-3 pipelines, 1-4 stages, TP 1 and 2,
micro-batch sizes 1-4, unlike slowdowns; every device this machine's measured one, slowed), three of them and
Holmes' setting across network-namespace hosts
with one host's link shaped to 1 Gbit/s, and compares each run with two predictions of the same plan:
- analytic: the cost model alone (cluster file + catalog/measured matmul rates);
- calibrated: the cost model with the layer profile `flashflex profile --model` measured on this machine.
"calibrated" is the measured profile scaled by one short calibration run of another plan (`flashflex calibrate
RUN --layers PROFILE`), as a user's first run would. Holmes' setting end to end: three namespace hosts, the cluster file measured by `flashflex profile
--distributed` across them, the flashflex plan and the uniform plan both planned and launched there.

Every emulated device is one thread pinned to one core (hardware/cpu_share.py), and every cluster leaves
each core headroom (the demand of the devices pinned there, sum of 1 / slowdown, at most 0.75 of it), so a
device runs as its cluster file says even beside the launcher and gloo's threads.
Measured iteration time: the median step time after the warm-up steps. Measured memory (CPU): the largest
rank's peak RSS above what it held before the first step; predicted: the cost model's bytes that training
adds to a built stage (everything but its weights: gradients, optimizer state, activations, logits, DP
reduction buffers and the device's fixed growth).
Beside each run: wall time, CPU time of its processes, 1-minute load average before and after.

Targets (calibrated): median absolute time error <= 10%, worst <= 25%, Spearman rank correlation >= 0.9,
and the plan predicted fastest (of all validated plans) is the fastest measured; the same check within each
cluster is printed too (near-ties there are decided by measurement noise of a few percent).

Sharded optimizer state (`--sharded`, or `--sharded-only` for that part alone): llama-small on four emulated
devices whose memory is set so that, unsharded, only one deep pipeline fits (pp4; dp2 x pp2 needs more than a
device has), while dp2 x pp2 fits with its optimizer state sharded across the two replicas. Both, and the plans
`flashflex plan --shard-optimizer off|on` makes for that cluster (layers and batch shares by device speed, where the
hand-written pair splits layers equally and is bound alike by the slowest device), run `REPEATS`
times (the run-to-run spread of this shared host is printed: the measured gain must exceed it to mean
anything), with predicted and measured step time and memory as above, and every rank of both plans trains
in-process under PyTorch's tensor accounting (tests/infra/tensor_accounting.py): its peak against the cost model's
prediction for that rank, its own shard (target: within 3%).

Run (root, for the namespaces): .venv/bin/python benchmarks/validate_cost_model.py [--steps N] [--no-netns]
Last line: `validate_cost_model: N plans, median error X%, worst Y%, spearman Z, top1 ok|wrong`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/infra/netns.py, benchmarks/commands.py

from benchmarks.commands import CommandFailed, run, run_all, usage  # noqa: E402

from flashflex_cli.hardware.cluster import load_cluster  # noqa: E402
from flashflex_cli.model.hf_config import resolve_model  # noqa: E402
from flashflex_cli.plan.schema import Plan, save_plan  # noqa: E402

BIN = Path(sys.executable).parent
FLASHFLEX = str(BIN / "flashflex")
MODEL, SEQ, BATCH, DTYPE = "llama-small", 128, 16, "fp32"
WARMUP = 2
# Emulated clusters whose devices leave each core headroom (the launcher, gloo's threads and the host's other
# load run there too): device i sits on core i mod 2, and a device at slowdown k uses 1/k of its core.
LOCAL_CLUSTERS = {
    "two": "1x2xcpu:slowdown=2,4",        # core 0: 0.5, core 1: 0.25
    "three": "1x3xcpu:slowdown=2,4,4",    # core 0: 0.75, core 1: 0.25
    "four": "1x4xcpu:slowdown=2,4,4,8",   # core 0: 0.75, core 1: 0.375
}
NETNS_SLOWDOWN = (2.0, 4.0, 4.0)  # the 3 namespace hosts, one device each (cores 0, 1, 0: 0.75 and 0.25)
Stage = tuple[list[str], tuple[int, int]]


@dataclass(frozen=True)
class Case:
    """A plan to run: its cluster, and per pipeline (micro-batch size, micro-batches, stages)."""

    name: str
    cluster: str
    pipelines: list[tuple[int, int, list[Stage]]]
    strategy: str = ""  # "flashflex" / "uniform": planned by `flashflex plan` instead of written here
    sharded: bool = False  # the optimizer state sharded across each slice's holders (equal shards)


L = resolve_model(MODEL).num_layers
# The calibration run: launched first, its measured stage times scale the measured layer profile
# (`flashflex calibrate RUN --layers PROFILE`); it is not one of the validated plans.
CALIBRATION = Case("calibration", "two", [(2, 8, [(["node0/0"], (0, 4)), (["node0/1"], (4, L))])])
CASES = [
    Case("one-fast-dev", "two", [(4, 4, [(["node0/0"], (0, L))])]),
    Case("one-slow-dev", "two", [(2, 8, [(["node0/1"], (0, L))])]),
    Case("pp2-mbs1", "two", [(1, 16, [(["node0/0"], (0, 5)), (["node0/1"], (5, L))])]),
    Case("pp2-mbs4", "two", [(4, 4, [(["node0/0"], (0, 5)), (["node0/1"], (5, L))])]),
    Case("dp2-unequal", "two", [(2, 5, [(["node0/0"], (0, L))]), (2, 3, [(["node0/1"], (0, L))])]),
    Case("tp2", "two", [(2, 8, [(["node0/0", "node0/1"], (0, L))])]),
    Case("pp4", "four", [(1, 16, [(["node0/0"], (0, 3)), (["node0/1"], (3, 6)), (["node0/2"], (6, 7)),
                                  (["node0/3"], (7, L))])]),
    Case("dp2-pp2", "four", [(2, 4, [(["node0/0"], (0, 5)), (["node0/2"], (5, L))]),
                             (2, 4, [(["node0/1"], (0, 5)), (["node0/3"], (5, L))])]),
    Case("tp2-tp2", "four", [(2, 8, [(["node0/0", "node0/1"], (0, 5)), (["node0/2", "node0/3"], (5, L))])]),
    Case("tp2+pp2", "four", [(4, 3, [(["node0/0", "node0/1"], (0, L))]),
                             (2, 2, [(["node0/2"], (0, 4)), (["node0/3"], (4, L))])]),
    Case("dp3-unequal", "three", [(2, 3, [(["node0/0"], (0, L))]), (2, 3, [(["node0/1"], (0, L))]),
                                  (1, 4, [(["node0/2"], (0, L))])]),
    Case("slow-heavy", "two", [(2, 8, [(["node0/0"], (0, 1)), (["node0/1"], (1, L))])]),
    Case("dp2-pp2-mbs1", "four", [(1, 8, [(["node0/0"], (0, 4)), (["node0/2"], (4, L))]),
                                  (1, 8, [(["node0/1"], (0, 4)), (["node0/3"], (4, L))])]),
    Case("pp3-mbs2", "three", [(2, 8, [(["node0/0"], (0, 3)), (["node0/1"], (3, 6)), (["node0/2"], (6, L))])]),
    Case("hosts-pp3", "netns", [(2, 8, [(["h0/0"], (0, 3)), (["h1/0"], (3, 6)), (["h2/0"], (6, L))])]),
    Case("hosts-dp3", "netns", [(2, 3, [(["h0/0"], (0, L))]), (2, 3, [(["h1/0"], (0, L))]),
                                (2, 2, [(["h2/0"], (0, L))])]),
    Case("hosts-flashflex", "netns", [], strategy="flashflex"),
    Case("hosts-uniform", "netns", [], strategy="uniform"),
]


@dataclass
class Result:
    """One plan: predicted (analytic, calibrated) and measured iteration seconds and memory bytes."""

    case: Case
    analytic_s: float = 0.0
    calibrated_s: float = 0.0
    measured_s: float = 0.0
    analytic_mem: float = 0.0
    calibrated_mem: float = 0.0
    measured_mem: float = 0.0
    run: dict[str, float] = field(default_factory=dict)


# ---- running commands -----------------------------------------------------------------------------
def measured(run_dir: Path) -> tuple[float, float]:
    """(median step seconds after the warm-up, largest rank's peak RSS growth in bytes) of a finished run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows[WARMUP:]] or [r["step_time_s"] for r in rows]
    growth = max(r.get("memory_growth_bytes", r["memory_bytes"]) for r in rows)
    return statistics.median(times), float(growth)


# ---- clusters and plans ---------------------------------------------------------------------------
def local_cluster(name: str, work: Path) -> Path:
    """An emulated CPU cluster of this machine: its device as `flashflex profile` measured it (matmul rate, memory
    bandwidth), once per core slot of `LOCAL_CLUSTERS[name]`, each with its slowdown: the analytic model then
    predicts from measured figures, as it would for a user's own profiled cluster."""
    from flashflex_cli.hardware.cluster import Cluster, save_cluster

    base = work / "this-machine.json"
    if not base.exists():
        run([FLASHFLEX, "profile", "--out", str(base), "--name", "this-machine"])
    device = load_cluster(base).nodes[0].devices[0]
    slowdowns = [float(x) for x in LOCAL_CLUSTERS[name].split("slowdown=")[1].split(",")]
    node = {"name": "node0", "nic": "eth", "intra_link": {"kind": "shm"},
            "devices": [{**device.model_dump(mode="json", exclude_none=True), "slowdown": k} for k in slowdowns]}
    path = work / f"{name}.json"
    save_cluster(path, Cluster.model_validate({"name": name, "nodes": [node]}))
    return path


def write_plan(case: Case, cluster_path: Path, work: Path) -> Path:
    """A plan file for a hand-written case (predictions are filled by `show`)."""
    cluster = load_cluster(cluster_path)
    train = {"global_batch": BATCH, "seq_len": SEQ, "dtype": DTYPE, "attention": "sdpa"}
    data = {"schema": "flashflex.plan/1",
            "inputs": {"cluster_sha256": cluster.sha256(), "cluster_name": cluster.name,
                       "model": resolve_model(MODEL).model_dump(), "train": train, "strategy": "manual"},
            "pipelines": [{"micro_batch_size": mbs, "num_micro_batches": m,
                           "stages": [{"devices": devs, "tp": len(devs), "layers": list(layers)}
                                      for devs, layers in stages]}
                          for mbs, m, stages in case.pipelines]}
    if case.sharded:
        data["optimizer_sharding"] = {}
    used = {d for _, _, stages in case.pipelines for devs, _ in stages for d in devs}
    data["unused_devices"] = [{"device": d, "reason": "not in this validation case"}
                              for d in cluster.device_ids if d not in used]
    path = work / f"{case.name}.plan.json"
    save_plan(path, Plan.model_validate(data))
    return path


def planned(case: Case, cluster_path: Path, layers: Path, work: Path) -> Path:
    """A plan made by `flashflex plan` (with the measured layer profile) for a planner case."""
    path = work / f"{case.name}.plan.json"
    run([FLASHFLEX, "plan", str(cluster_path), "--model", MODEL, "--global-batch", str(BATCH), "--seq-len", str(SEQ),
         "--dtype", DTYPE, "--attention", "sdpa", "--strategy", case.strategy, "--layers", str(layers),
         "--no-baseline", "--out", str(path)])
    return path


def prediction(plan: Path, cluster: Path, layers: Path | None) -> tuple[float, float]:
    """(iteration seconds, largest stage's training memory in bytes) from `flashflex show --json`."""
    extra = ["--layers", str(layers)] if layers else []
    shown = json.loads(run([FLASHFLEX, "show", str(plan), "--cluster", str(cluster), "--json", *extra]).stdout)
    predicted = shown["predicted"]
    memory = max(training_bytes(stage) for stage in predicted["stages"])
    return float(predicted["iteration_time_s"]), memory


def training_bytes(stage: dict[str, Any]) -> float:
    """What training adds to a built stage on an emulated CPU device: everything but its weights (gradients,
    optimizer state, activations, logits, DP buffers and the device's fixed growth, `reserve`, which on CPU
    is RSS growth beyond the counted tensors, or a layer profile's fixed bytes)."""
    mem = stage["memory"]
    return mem["total"] - mem["weights"] - mem.get("embedding_head_weights", 0.0)


# ---- launching ----------------------------------------------------------------------------------------
def launch_local(plan: Path, cluster: Path, out: Path, steps: int) -> dict[str, float]:
    """`flashflex launch` on this host; wall and CPU seconds, load before and after."""
    with usage() as figures:
        run([FLASHFLEX, "launch", str(plan), "--cluster", str(cluster), "--out", str(out), "--steps", str(steps),
             "--timeout", "120", "--overwrite", "--no-checkpoint"], timeout=900)
    return figures


def launch_hosts(net: Any, plan: Path, cluster: Path, out: Path, steps: int, run_id: str) -> dict[str, float]:
    """Render the plan's torchrun commands and run line i inside namespace host i, all at once."""
    rendered = run([FLASHFLEX, "launch", str(plan), "--cluster", str(cluster), "--steps", str(steps),
                    "--out", str(out), "--launcher", "torchrun", "--hosts", ",".join(h.addr for h in net.hosts),
                    "--ifname", ",".join(h.ifname for h in net.hosts), "--run-id", run_id, "--timeout", "120",
                    "--torchrun", str(BIN / "torchrun"), "--overwrite", "--no-checkpoint"])
    lines = [x for x in rendered.stdout.splitlines() if x.strip() and not x.startswith("#")]
    with usage() as figures:
        run_all([([*net.prefix_cmd(i), "bash", "-c", line], None) for i, line in enumerate(lines)], 900)
    return figures


def profile_hosts(net: Any, out: Path) -> Path:
    """`flashflex profile --distributed` across the namespace hosts (one emulated device each)."""
    commands = []
    for i in range(len(net.hosts)):
        command = [*net.prefix_cmd(i), sys.executable, "-m", "torch.distributed.run",
                   *net.torchrun_args(i, port=29611, rdzv_id="validate-profile"), "-m", "flashflex_cli.cli",
                   "profile", "--distributed", "--quick", "--node-name", f"h{i}", "--slowdown", str(NETNS_SLOWDOWN[i]),
                   "--out", str(out)]
        commands.append((command, net.torchrun_env(i)))
    run_all(commands, 300, label="distributed profile")
    return out


# ---- statistics -----------------------------------------------------------------------------------
def ranks(values: list[float]) -> list[float]:
    """Average ranks (ties share the mean rank), 1-based."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation: Pearson correlation of the ranks."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def top1_ok(results: list[Result], predicted: str) -> bool:
    """The plan predicted fastest of all validated plans is the one measured fastest."""
    return min(results, key=lambda r: getattr(r, predicted)) is min(results, key=lambda r: r.measured_s)


def top1_per_cluster(results: list[Result], predicted: str) -> list[str]:
    """Per cluster with several plans: "cluster ok", or "cluster wrong (X predicted fastest, measured N%
    slower than Y)"."""
    groups: dict[str, list[Result]] = {}
    for r in results:
        groups.setdefault(r.case.cluster, []).append(r)
    out = []
    for name, group in groups.items():
        if len(group) < 2:
            continue
        pick = min(group, key=lambda r: getattr(r, predicted))
        best = min(group, key=lambda r: r.measured_s)
        out.append(f"{name} ok" if pick is best else
                   f"{name} wrong ({pick.case.name} predicted fastest, measured "
                   f"{pick.measured_s / best.measured_s - 1:.1%} slower than {best.case.name})")
    return out


def error(predicted: float, actual: float) -> float:
    """Signed relative error of a prediction (predicted / actual - 1)."""
    return predicted / actual - 1.0


# ---- main ---------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=8, help="Training steps per run (first 2 are warm-up).")
    parser.add_argument("--no-netns", action="store_true", help="Skip the namespace-host plans.")
    parser.add_argument("--work", type=Path, default=None, help="Keep files here (default: a temp folder).")
    parser.add_argument("--sharded", action="store_true", help="Also the sharded-optimizer runs (docstring).")
    parser.add_argument("--sharded-only", action="store_true", help="Only the sharded-optimizer runs.")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="validate-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"host: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; work folder {work}", flush=True)
    if args.sharded or args.sharded_only:
        run_sharded(work, args.steps)
        if args.sharded_only:
            return

    clusters = {name: local_cluster(name, work) for name in LOCAL_CLUSTERS}
    layers = calibrated_profile(work, clusters[CALIBRATION.cluster], args.steps)
    results: list[Result] = []
    local = [c for c in CASES if c.cluster != "netns"]
    hosts = [c for c in CASES if c.cluster == "netns"]
    for case in local:
        results.append(run_case(case, clusters[case.cluster], layers, work, args.steps))
    if not args.no_netns:
        results.extend(run_netns(hosts, layers, work, args.steps))
    report(results)


def calibrated_profile(work: Path, cluster: Path, steps: int) -> Path:
    """`flashflex profile --model` on this machine, then `flashflex calibrate` of one short run (the
    CALIBRATION plan, not validated) that scales it: the calibrated layer profile."""
    measured_layers, layers = work / "cpu.measured.layers.json", work / "cpu.layers.json"
    with usage() as spent:
        run([FLASHFLEX, "profile", "--model", MODEL, "--seq-len", str(SEQ), "--micro-batch", "1,2,4,8", "--tp",
             "1,2", "--dtype", DTYPE, "--attention", "sdpa", "--repeats", "7", "--out", str(measured_layers)],
            timeout=1200)
    print(f"profiled {MODEL} layers in {spent['wall_s']:.1f} s wall, {spent['cpu_s']:.1f} s CPU", flush=True)
    plan = write_plan(CALIBRATION, cluster, work)
    launch_local(plan, cluster, work / "run-calibration", steps)
    done = run([FLASHFLEX, "calibrate", str(work / "run-calibration"), "--layers", str(measured_layers),
                "--out", str(layers)])
    print("calibration run" + next((line for line in done.stdout.splitlines() if "measured forward" in line), ""),
          flush=True)
    return layers


def run_case(case: Case, cluster: Path, layers: Path, work: Path, steps: int, net: Any = None,
             layers_used: bool = True) -> Result:
    """Predict `case` both ways (analytic only without `layers_used`), launch it, measure it; print one line."""
    plan = planned(case, cluster, layers, work) if case.strategy else write_plan(case, cluster, work)
    result = Result(case)
    result.analytic_s, result.analytic_mem = prediction(plan, cluster, None)
    result.calibrated_s, result.calibrated_mem = prediction(plan, cluster, layers if layers_used else None)
    out = work / f"run-{case.name}"
    if net is None:
        result.run = launch_local(plan, cluster, out, steps)
    else:
        result.run = launch_hosts(net, plan, cluster, out, steps, f"validate-{case.name}")
    result.measured_s, result.measured_mem = measured(out)
    r = result.run
    print(f"{case.name:16s} {case.cluster:6s} measured {result.measured_s * 1e3:8.1f} ms | "
          f"analytic {result.analytic_s * 1e3:8.1f} ms ({error(result.analytic_s, result.measured_s):+6.1%}) | "
          f"calibrated {result.calibrated_s * 1e3:8.1f} ms ({error(result.calibrated_s, result.measured_s):+6.1%}) | "
          f"memory measured {result.measured_mem / 2**20:7.1f} MiB, analytic "
          f"{error(result.analytic_mem, result.measured_mem):+6.1%}, calibrated "
          f"{error(result.calibrated_mem, result.measured_mem):+6.1%} | wall {r['wall_s']:.1f} s, CPU "
          f"{r['cpu_s']:.1f} s, load {r['load_before']:.2f}->{r['load_after']:.2f}", flush=True)
    return result


def run_netns(cases: list[Case], layers: Path, work: Path, steps: int) -> list[Result]:
    """The namespace-host plans, Holmes' setting among them: 3 hosts, host 2's link shaped to 1 Gbit/s."""
    from tests.infra.netns import NetnsHosts, netns_available

    ok, why = netns_available()
    if not ok:
        print(f"namespace hosts skipped: {why}")
        return []
    out: list[Result] = []
    with NetnsHosts(3, shape={2: "1gbit"}) as net:
        cluster = profile_hosts(net, work / "netns.json")
        described = load_cluster(cluster)
        pairs = ", ".join(f"{p.a}-{p.b} {p.bandwidth * 8 / 1e9:.2f} Gbit/s" for p in described.inter_node.pairs)
        print(f"namespace cluster (profile --distributed): {pairs}", flush=True)
        for case in cases:
            out.append(run_case(case, cluster, layers, work, steps, net=net))
    by_name = {r.case.name: r for r in out}
    flex, uni = by_name.get("hosts-flashflex"), by_name.get("hosts-uniform")
    if flex and uni:
        print(f"Holmes setting: flashflex/uniform measured {uni.measured_s / flex.measured_s:.2f}x, "
              f"predicted {uni.calibrated_s / flex.calibrated_s:.2f}x (calibrated), "
              f"{uni.analytic_s / flex.analytic_s:.2f}x (analytic)", flush=True)
    return out


# ---- sharded optimizer state ----------------------------------------------------------------------------
REPEATS = 3
SHARDED_CASES = [  # one deep pipeline (all that fits unsharded), and two replicas that fit only sharded
    Case("shard-off-pp4", "tight", [(1, 16, [(["node0/0"], (0, 2)), (["node0/1"], (2, 4)), (["node0/2"], (4, 6)),
                                              (["node0/3"], (6, L))])]),
    Case("shard-on-dp2-pp2", "tight", [(1, 8, [(["node0/0"], (0, 4)), (["node0/2"], (4, L))]),
                                       (1, 8, [(["node0/1"], (0, 4)), (["node0/3"], (4, L))])], sharded=True),
]


def tight_cluster(work: Path) -> Path:
    """The "four" cluster with every device's memory set halfway between what dp2 x pp2 needs with its optimizer
    state sharded and without (the cost model's totals), above what pp4 needs: unsharded, only pp4 fits."""
    from dataclasses import replace as replaced

    from flashflex_cli.cost.estimate import estimate
    from flashflex_cli.cost.params import CostParams
    from flashflex_cli.hardware.cluster import Cluster, save_cluster

    four = local_cluster("four", work)
    base = load_cluster(four)
    need = {}
    for case in SHARDED_CASES + [replaced(SHARDED_CASES[1], name="dp2-pp2-unsharded", sharded=False)]:
        plan = Plan.model_validate_json(write_plan(replaced(case, cluster="four"), four, work).read_text())
        need[case.name] = max(st.memory.total for st in estimate(plan, base).stages)
    low, high = need["shard-on-dp2-pp2"], need["dp2-pp2-unsharded"]
    if not (need["shard-off-pp4"] < high and low < high):
        raise CommandFailed(f"no memory size separates the sharded plans: {need}")
    memory = int(max(need["shard-off-pp4"], low, (low + high) / 2) / (1.0 - CostParams().memory_safety_margin))
    data = base.model_dump(mode="json", exclude_none=True)
    for node in data["nodes"]:
        for device in node["devices"]:
            device["memory_bytes"] = memory
    path = work / "tight.json"
    save_cluster(path, Cluster.model_validate({**data, "name": "tight"}))
    print(f"tight cluster: {memory / 2**20:.1f} MiB per device; largest stage needs pp4 "
          f"{need['shard-off-pp4'] / 2**20:.1f} MiB, dp2 x pp2 {high / 2**20:.1f} MiB unsharded, "
          f"{low / 2**20:.1f} MiB sharded", flush=True)
    return path


def tracked_job(rank: int, world: int, plan_json: str, init_file: str, out_dir: str) -> None:
    """3 steps of the plan on `rank` under tensor accounting (as tests/test_memory_tracked.py); the lowest
    steady step's peak of live tensor bytes."""
    import torch
    from tests.infra.tensor_accounting import TensorAccounting
    from tests.infra.worker_pool import gloo_rank

    from flashflex_cli.runtime.parallel.groups import build_groups
    from flashflex_cli.runtime.training.engine import OptimConfig, RankEngine

    with gloo_rank(rank, world, init_file):
        plan = Plan.model_validate_json(plan_json)
        groups = build_groups(plan, rank)
        train = plan.inputs.train
        generator = torch.Generator().manual_seed(5)
        first = sum(pipe.sequences for pipe in plan.pipelines[:groups.pipeline])
        rows = slice(first, first + plan.pipelines[groups.pipeline].sequences)
        batches = [torch.randint(0, plan.inputs.model.vocab_size, (train.global_batch, train.seq_len + 1),
                                 generator=generator)[rows] for _ in range(3)]
        with TensorAccounting() as accounting:
            engine = RankEngine(plan, rank, groups, torch.device("cpu"), OptimConfig(lr=1e-3), seed=3)
            engine.train_step(batches[0].clone())
            peaks = []
            for tokens in batches[1:]:
                accounting.reset_peak()
                engine.train_step(tokens.clone())
                peaks.append(accounting.peak_bytes)
        torch.save({"peak": min(peaks)}, Path(out_dir) / f"rank{rank}.pt")


def tracked_errors(plan_path: Path, cluster_path: Path, work: Path) -> list[str]:
    """Every rank's tracked peak against the cost model's allocated bytes for that rank (its own shard)."""
    import torch
    from tests.infra.worker_pool import WorkerPool

    from flashflex_cli.cost.dp import dp_buckets, dp_partners
    from flashflex_cli.cost.estimate import plan_stage_memory
    from flashflex_cli.cost.params import CostParams
    from flashflex_cli.semantics.optimizer_shards import shard_counts

    plan = Plan.model_validate_json(plan_path.read_text())
    out = work / f"tracked-{plan_path.stem}"
    out.mkdir(exist_ok=True)
    with WorkerPool(plan.world_size, tracked_job) as pool:
        pool.run([(rank, plan.world_size, plan.to_json(), str(out / "store"), str(out))
                  for rank in range(plan.world_size)], 600)
    cluster, params = load_cluster(cluster_path), CostParams()
    partners = dp_partners(dp_buckets(plan, cluster, params))
    counts = shard_counts(plan)
    lines = []
    for info in plan.ranks():
        peak = torch.load(out / f"rank{info.rank}.pt")["peak"]
        mem = plan_stage_memory(plan, cluster, params, info.pipeline, info.stage, None,
                                bool(partners.get((info.pipeline, info.stage))), 0.0, counts[info.rank])
        lines.append(f"rank {info.rank} (p{info.pipeline}.s{info.stage}): tracked {peak / 2**20:.2f} MiB, predicted "
                     f"{mem.allocated / 2**20:.2f} MiB ({mem.phase}), {error(mem.allocated, peak):+.2%}; "
                     f"optimizer state {mem.optimizer / 2**20:.2f} MiB")
    return lines


def run_sharded(work: Path, steps: int) -> None:
    """The sharded-optimizer runs (module docstring)."""
    cluster = tight_cluster(work)
    planned_plans: dict[str, Path] = {}
    for mode in ("off", "on"):  # what the planner makes of the tight cluster, without and with sharding
        out = work / f"tight-{mode}.plan.json"
        run([FLASHFLEX, "plan", str(cluster), "--model", MODEL, "--global-batch", str(BATCH), "--seq-len", str(SEQ),
             "--dtype", DTYPE, "--attention", "sdpa", "--no-baseline", "--shard-optimizer", mode, "--micro-batch",
             "1", "--out", str(out)])
        plan = Plan.model_validate_json(out.read_text())
        planned_plans[f"planned-shard-{mode}"] = out
        print(f"flashflex plan --shard-optimizer {mode}: {len(plan.pipelines)} pipeline(s) of "
              f"{', '.join(str(len(p.stages)) for p in plan.pipelines)} stages, predicted "
              f"{plan.predicted['iteration_time_s'] * 1e3:.0f} ms" if plan.predicted else "", flush=True)
    for case in SHARDED_CASES:
        plan = write_plan(case, cluster, work)
        shown = json.loads(run([FLASHFLEX, "show", str(plan), "--cluster", str(cluster), "--json"]).stdout)
        print(f"{case.name}: fits {shown['predicted']['fits']}", flush=True)
        for line in tracked_errors(plan, cluster, work):
            print(f"  {line}", flush=True)
    # timed: the hand-written pair (equal layer splits: the slowest device bounds both alike) and the planner's
    # own pair (layers and batch shares by device speed: what a user runs), interleaved so load drifts hit both
    times: dict[str, list[float]] = {}
    predicted: dict[str, float] = {}
    for _ in range(REPEATS):
        for case in SHARDED_CASES:
            result = run_case(case, cluster, Path(), work, steps, layers_used=False)
            times.setdefault(case.name, []).append(result.measured_s)
            predicted[case.name] = result.analytic_s
        for name, plan_path in planned_plans.items():
            out = work / f"run-{name}"
            figures = launch_local(plan_path, cluster, out, steps)
            times.setdefault(name, []).append(measured(out)[0])
            predicted[name] = prediction(plan_path, cluster, None)[0]
            print(f"{name:16s} measured {times[name][-1] * 1e3:8.1f} ms | predicted {predicted[name] * 1e3:8.1f} ms | "
                  f"wall {figures['wall_s']:.1f} s, CPU {figures['cpu_s']:.1f} s, load "
                  f"{figures['load_before']:.2f}->{figures['load_after']:.2f}", flush=True)
    for name, values in times.items():
        spread = (max(values) - min(values)) / statistics.median(values)
        print(f"{name}: measured step {', '.join(f'{v * 1e3:.0f}' for v in values)} ms, median "
              f"{statistics.median(values) * 1e3:.0f} ms, run-to-run spread {spread:.1%}, predicted "
              f"{predicted[name] * 1e3:.0f} ms", flush=True)
    off, on = (statistics.median(times[c.name]) for c in SHARDED_CASES)
    planned_off, planned_on = (statistics.median(times[name]) for name in planned_plans)
    print(f"validate_cost_model sharded: planner's sharded vs unsharded plan measured {planned_off / planned_on:.3f}x "
          f"(predicted {predicted['planned-shard-off'] / predicted['planned-shard-on']:.3f}x); hand-written dp2 x pp2 "
          f"sharded vs pp4 unsharded measured {off / on:.3f}x", flush=True)


def report(results: list[Result]) -> None:
    """Summary per model, then the benchmark's last line (calibrated)."""
    measured_s = [r.measured_s for r in results]
    for label, attr, mem in (("analytic", "analytic_s", "analytic_mem"),
                             ("calibrated", "calibrated_s", "calibrated_mem")):
        errs = [abs(error(getattr(r, attr), r.measured_s)) for r in results]
        mems = [abs(error(getattr(r, mem), r.measured_mem)) for r in results if r.measured_mem > 0]
        print(f"{label:10s}: time error median {statistics.median(errs):.1%}, worst {max(errs):.1%}, spearman "
              f"{spearman([getattr(r, attr) for r in results], measured_s):.3f}, top1 "
              f"{'ok' if top1_ok(results, attr) else 'wrong'}; memory error median "
              f"{statistics.median(mems):.1%}, worst {max(mems):.1%}")
        print(f"{'':10s}  top1 within each cluster: {'; '.join(top1_per_cluster(results, attr))}")
    errs = [abs(error(r.calibrated_s, r.measured_s)) for r in results]
    rho = spearman([r.calibrated_s for r in results], measured_s)
    print(f"validate_cost_model: {len(results)} plans, median error {statistics.median(errs) * 100:.1f}%, "
          f"worst {max(errs) * 100:.1f}%, spearman {rho:.2f}, top1 {'ok' if top1_ok(results, 'calibrated_s') else 'wrong'}")


if __name__ == "__main__":
    try:
        main()
    except CommandFailed as exc:  # a failed command: its output, exit 1
        sys.exit(str(exc))

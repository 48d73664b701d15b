"""Benchmark (a): planning time against cluster size and class, 8 to 1024 devices.

Two sets of clusters, seq len 4096, bf16:
- `mixed-N` (--sizes): N devices in nodes of 8 cycling through A100-80G (InfiniBand, NVLink) / 4090 / 3090
  (Ethernet) / A100-40G (RoCE), llama2-7b, global batch max(64, 2N);
- the classes (--classes): other type mixes and fabrics, 70B-class models, global batches in the thousands,
  256 to 1024 devices (`CLASSES`: two types on InfiniBand; three types on 10 Gbit/s Ethernet; H100 / A100 / L40S
  nodes on InfiniBand / RoCE / Ethernet; the same with seven NIC bandwidths (21 kinds of node); PCIe A100 nodes
  with 4-GPU 4090 nodes; three types in blocks; 128 H200 nodes).
Targets: CPU time (the planning process and its workers) at most 4 s at 768 devices and 6 s at 1024 for every
cluster with --jobs 1 (the same minute's load, min over --repeats runs); wall time 128 devices under 5 s, 1024 under
60 s on the 2-core CI machine. The baseline in the same run is the `uniform` strategy (a closed-form sweep of
symmetric layouts); the ratio shows what the full search costs on top. `--max-micro-batch N` turns on the
micro-batch search (default: pinned at 1, the plans of the speed target).
`--cold` runs every repeat in a fresh interpreter, as `flashflex plan` does: without it, later repeats reuse the
cost model's memos (1F1B simulations, stage memory) that the first one filled, and the minimum is a warm run.
`--against SRC` compares with another version of the package (SRC: its `src` folder, e.g. of a `git worktree` of an
earlier commit), run for run in fresh interpreters: on a shared, noisy host the only fair comparison of two versions.
Usage: python benchmarks/bench_planning_time.py [--sizes 8,32,128] [--classes all|none|NAME,...] [--jobs 1]
       [--repeats 2] [--max-micro-batch 8] [--shard-optimizer auto|on|off] [--cold] [--against SRC]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from flashflex_cli.cost.params import CostParams  # noqa: E402
from flashflex_cli.hardware.cluster import Cluster  # noqa: E402
from flashflex_cli.hardware.synthetic import build_cluster  # noqa: E402
from flashflex_cli.model.spec import PRESETS, ModelSpec  # noqa: E402
from flashflex_cli.plan.schema import TrainConfig  # noqa: E402
from flashflex_cli.planner.search import SearchStats, plan_layout  # noqa: E402
from flashflex_cli.planner.search.sharding import choose_sharding  # noqa: E402

TYPES = ("A100-80G-SXM:nic=ib:link=nvlink", "RTX-4090:nic=eth", "RTX-3090:nic=eth", "A100-40G-SXM:nic=roce")
WALL_TARGETS = {128: 5.0, 1024: 60.0}  # seconds of wall time by cluster size
CPU_TARGETS = {768: 4.0, 1024: 6.0}  # seconds of CPU time by cluster size, --jobs 1


def mixed_spec(devices: int) -> str:
    """`devices` devices in nodes of 8 (or one smaller node), cycling through four device types."""
    per_node = min(8, devices)
    nodes = devices // per_node
    groups = [f"1x{per_node}x{TYPES[n % len(TYPES)].split(':')[0]}:{TYPES[n % len(TYPES)].split(':', 1)[1]}"
              for n in range(nodes)]
    return ",".join(groups)


def cycled(devices: int, kinds: tuple[str, ...], per_node: int = 8) -> str:
    """`devices` devices in nodes of `per_node`, the nodes cycling through `kinds` (a type and its options)."""
    return ",".join(f"1x{per_node}x{kinds[n % len(kinds)]}" for n in range(devices // per_node))


def fabrics_spec(devices: int) -> str:
    """H100 (InfiniBand) / A100-80G (RoCE) / L40S (Ethernet) nodes of 8, their NICs cycling through seven
    bandwidths (25 to 400 Gbit/s): 21 kinds of node, so fewer equal groups share a structure search."""
    kinds = ("H100-SXM:nic=ib", "A100-80G-SXM:nic=roce", "L40S:nic=eth")
    bandwidths = (100, 200, 50, 400, 25, 40, 80)
    return ",".join(f"1x8x{kinds[n % 3]}:bw={bandwidths[n % 7]}" for n in range(devices // 8))


TRI = ("H100-SXM:nic=ib", "A100-80G-SXM:nic=roce", "L40S:nic=eth")
ETH10 = ("A100-80G-SXM:nic=eth:bw=10", "RTX-4090:nic=eth:bw=10", "RTX-3090:nic=eth:bw=10")
CLASSES = (  # name, synthetic spec, model, global batch (sequences)
    ("two-70b-256", "16x8xH100-SXM:nic=ib,16x8xA100-80G-SXM:nic=ib", "llama3-70b", 1024),
    ("eth10-13b-512", cycled(512, ETH10), "llama2-13b", 4096),
    ("tri-70b-768", cycled(768, TRI), "llama3-70b", 2048),
    ("fabrics-70b-768", fabrics_spec(768), "llama2-70b", 4096),
    ("pcie-13b-768", "64x8xA100-80G-PCIe:nic=roce:link=pcie,64x4xRTX-4090:nic=eth", "llama2-13b", 3072),
    ("tri-70b-1024", cycled(1024, TRI), "llama2-70b", 4096),
    ("fabrics-70b-1024", fabrics_spec(1024), "llama3-70b", 2048),
    ("blocks-70b-1024", "48x8xH100-SXM:nic=ib,48x8xA100-40G-SXM:nic=roce,32x8xV100-32G:nic=eth", "llama2-70b", 2048),
    ("homo-70b-1024", "128x8xH200:nic=ib", "llama3-70b", 4096),
)


def clusters(sizes: str, classes: str) -> list[tuple[str, str, str, int]]:
    """(name, spec, model, global batch) of every cluster asked for."""
    out = [(f"mixed-{n}", mixed_spec(n), "llama2-7b", max(64, 2 * n))
           for n in (int(s) for s in sizes.split(",") if s.strip())]
    if classes == "all":
        out += list(CLASSES)
    elif classes != "none":
        wanted = [c.strip() for c in classes.split(",") if c.strip()]
        known = {c[0]: c for c in CLASSES}
        unknown = [c for c in wanted if c not in known]
        if unknown:
            raise SystemExit(f"--classes: unknown {unknown[0]!r}; choose among {', '.join(known)}")
        out += [known[c] for c in wanted]
    return out


def main() -> None:
    from flashflex_cli.planner.search.pool import usable_cores

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32,128,512,1024", help="devices of the mixed-N clusters (empty: none)")
    parser.add_argument("--classes", default="all", help="all, none, or names from CLASSES separated by commas")
    parser.add_argument("--model", default=None, help="plan every cluster for this model instead of its own")
    parser.add_argument("--budget", type=float, default=60.0, help="--time-budget given to the planner (s)")
    parser.add_argument("--jobs", type=int, default=usable_cores(), help="planner worker processes")
    parser.add_argument("--repeats", type=int, default=1, help="runs per cluster; the minimum CPU time is shown")
    parser.add_argument("--max-micro-batch", type=int, default=None, help="search micro-batch sizes up to N")
    parser.add_argument("--shard-optimizer", default="off", choices=("auto", "on", "off"),
                        help="plan as `flashflex plan --shard-optimizer` (planner/search/sharding.py: auto and on "
                        "add the sharded searches where they are tried)")
    parser.add_argument("--cold", action="store_true",
                        help="run every repeat in a fresh interpreter, as `flashflex plan` runs (the cost model's "
                        "memos start empty; imports not counted)")
    parser.add_argument("--against", default=None, metavar="SRC",
                        help="also plan every cluster with the flashflex_cli package under SRC (e.g. a worktree's src "
                        "of an earlier commit), alternated with this one run for run, each in a fresh interpreter, and "
                        "print the CPU time of both and their ratio")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # --cold's child: plan this cluster once
    args = parser.parse_args()
    if args.one is not None:
        _plan_once(args)
        return
    if args.against is not None:
        _compare(args)
        return
    mode = f"searched up to {args.max_micro_batch}" if args.max_micro_batch else "pinned at 1"
    fresh = ", each in a fresh interpreter" if args.cold else " in one interpreter (later runs reuse the cost memos)"
    print(f"jobs {args.jobs}, micro-batch size {mode}, CPU time = min of {max(1, args.repeats)} runs{fresh}")
    print(f"{'cluster':<17} {'devices':>7} {'model':<11} {'batch':>5} {'flashflex s':>11} {'cpu s':>6} "
          f"{'uniform s':>9} {'ratio':>6} {'cands':>5} {'tokens/s':>11} {'vs uniform':>10} {'budget hit':>10} "
          f"{'load':>5} {'target':>8}")
    for name, spec, model_name, batch in clusters(args.sizes, args.classes):
        cluster = build_cluster(spec, name=name)
        size = len(cluster.device_ids)
        model = PRESETS[args.model or model_name]
        train = TrainConfig(global_batch=batch, seq_len=4096)
        runs = [(_fresh_run(args, name) if args.cold else _timed_run(args, cluster, model, train))
                for _ in range(max(1, args.repeats))]
        cpu, wall, stats, tps = min(runs, key=lambda r: (r[2].budget_hit, r[0]))  # a cut search did less work
        t1 = time.perf_counter()
        try:
            base = plan_layout(cluster, model, train, strategy="uniform")
            base_tps = base.predicted.tokens_per_s
        except Exception:  # noqa: BLE001 - no symmetric layout fits: report it, keep benchmarking
            base_tps = float("nan")
        uniform_s = time.perf_counter() - t1
        load = _load()
        print(f"{name:<17} {size:>7} {model.name:<11} {batch:>5} {wall:>11.2f} {cpu:>6.2f} {uniform_s:>9.2f} "
              f"{wall / max(uniform_s, 1e-9):>6.1f} {stats.candidates:>5} {tps:>11,.0f} {tps / base_tps:>9.2f}x "
              f"{str(stats.budget_hit):>10} {load:>5.1f} {_verdict(size, wall, cpu, args.jobs):>8}", flush=True)
    print(f"{os.cpu_count()} CPUs; wall time grows with the load average; CPU time (planner process plus its "
          f"workers) is what an idle machine's wall time would be with --jobs 1")


def _timed_run(args: argparse.Namespace, cluster: Cluster, model: ModelSpec, train: TrainConfig
               ) -> tuple[float, float, SearchStats, float]:
    """One planning run in this interpreter: (CPU s, wall s, its search stats, predicted tokens/s)."""
    stats = SearchStats()
    options = {"time_budget_s": args.budget, "stats": stats, "jobs": args.jobs, "max_micro_batch": args.max_micro_batch}
    try:  # the searches of one cluster sharing its device graph, as `flashflex plan` runs them
        from flashflex_cli.planner.search import searches_of
        search = searches_of(cluster, model, train, **options)
    except ImportError:  # (an earlier package, --against)
        search = lambda ways: plan_layout(cluster, model, train, optimizer_shard_ways=ways, **options)  # noqa: E731
    c0, t0 = _cpu_seconds(), time.perf_counter()
    plan, _ = choose_sharding(search, args.shard_optimizer, CostParams())
    return _cpu_seconds() - c0, time.perf_counter() - t0, stats, float(plan.predicted.tokens_per_s)


def _fresh_run(args: argparse.Namespace, name: str, src: str | None = None
               ) -> tuple[float, float, SearchStats, float]:
    """`_timed_run` of cluster `name` in a fresh interpreter (this script with --one), with the package under `src`
    when given."""
    command = [sys.executable, __file__, "--one", name, "--sizes", args.sizes, "--classes", args.classes,
               "--budget", str(args.budget), "--jobs", str(args.jobs), "--shard-optimizer", args.shard_optimizer]
    if args.model:
        command += ["--model", args.model]
    if args.max_micro_batch:
        command += ["--max-micro-batch", str(args.max_micro_batch)]
    env = None if src is None else {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.abspath(src), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout.split()
    stats = SearchStats()
    stats.candidates, stats.budget_hit = int(out[2]), out[3] == "True"
    return float(out[0]), float(out[1]), stats, float(out[4])


def _compare(args: argparse.Namespace) -> None:
    """--against: every cluster planned by this package and by the one under `args.against`, alternately, each run in
    a fresh interpreter; the minimum CPU time of each and their ratio (the same minutes' load for both)."""
    print(f"jobs {args.jobs}, CPU time = min of {max(1, args.repeats)} runs each, alternated, fresh interpreters; "
          f"against {args.against}")
    print(f"{'cluster':<17} {'this s':>7} {'against s':>9} {'ratio':>6} {'same tokens/s':>13} {'load':>5}")
    for name, *_ in clusters(args.sizes, args.classes):
        mine, theirs = [], []
        for _ in range(max(1, args.repeats)):
            mine.append(_fresh_run(args, name))
            theirs.append(_fresh_run(args, name, args.against))
        this, other = min(r[0] for r in mine), min(r[0] for r in theirs)
        same = {r[3] for r in mine} == {r[3] for r in theirs}
        load = _load()
        print(f"{name:<17} {this:>7.2f} {other:>9.2f} {this / other:>6.2f} {str(same):>13} {load:>5.1f}", flush=True)


def _plan_once(args: argparse.Namespace) -> None:
    """--cold's child: plan cluster `args.one` once and print CPU s, wall s, candidates, budget hit, tokens/s."""
    name, spec, model_name, batch = next(c for c in clusters(args.sizes, args.classes) if c[0] == args.one)
    cluster = build_cluster(spec, name=name)
    train = TrainConfig(global_batch=batch, seq_len=4096)
    cpu, wall, stats, tps = _timed_run(args, cluster, PRESETS[args.model or model_name], train)
    print(cpu, wall, stats.candidates, stats.budget_hit, tps)


def _verdict(size: int, wall: float, cpu: float, jobs: int) -> str:
    """The targets that apply to a cluster of `size` devices, met or missed."""
    parts = []
    if size in WALL_TARGETS:
        parts.append(f"wall {'ok' if wall < WALL_TARGETS[size] else 'MISSED'} <{WALL_TARGETS[size]:g}s")
    if size in CPU_TARGETS and jobs == 1:
        parts.append(f"cpu {'ok' if cpu <= CPU_TARGETS[size] else 'MISSED'} <={CPU_TARGETS[size]:g}s")
    return ", ".join(parts)


def _load() -> float:
    """The 1-minute load average (nan where the platform has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its waited-for children (the planner's workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


if __name__ == "__main__":
    main()

"""Part (B) of benchmarks/bench_low_comm.py: tokens/s of local sync against every synchronous layout of the same
two devices, on two network-namespace hosts joined by a shaped link (its docstring says what is measured)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.commands import CommandFailed, run, run_all, usage

BIN = Path(sys.executable).parent
FLASHFLEX = str(BIN / "flashflex")
PREFIX = "ffL"
SEQ_LEN = 128
PER_DEVICE = 8  # sequences per device per step; the synchronous layouts train 2 x PER_DEVICE a step too
TIMEOUT_S = 900.0


def gbit(rate: str) -> float:
    """A tc rate ("100mbit", "1gbit") in Gbit/s."""
    text = rate.lower()
    for suffix, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * scale
    raise SystemExit(f"--rate {rate!r}: give it as tc does, e.g. 100mbit or 1gbit")


def layouts(num_layers: int, inner_steps: int) -> dict[str, dict[str, Any]]:
    """Every layout of the two devices, as plan fragments (pipelines, unused devices, outer_sync)."""
    whole = [0, num_layers]
    half = num_layers // 2
    dp = [{"micro_batch_size": 4, "num_micro_batches": PER_DEVICE // 4,
           "stages": [{"devices": [f"node{i}/0"], "tp": 1, "layers": whole}]} for i in range(2)]
    return {
        "one device": {"pipelines": [{"micro_batch_size": 4, "num_micro_batches": 2 * PER_DEVICE // 4,
                                      "stages": [{"devices": ["node0/0"], "tp": 1, "layers": whole}]}],
                       "unused_devices": [{"device": "node1/0", "reason": "one-device layout"}]},
        "data parallel": {"pipelines": dp},
        "pipeline": {"pipelines": [{"micro_batch_size": 2, "num_micro_batches": PER_DEVICE,
                                    "stages": [{"devices": ["node0/0"], "tp": 1, "layers": [0, half]},
                                               {"devices": ["node1/0"], "tp": 1, "layers": [half, num_layers]}]}]},
        "local sync": {"pipelines": dp, "outer_sync": {"groups": [{"pipelines": [0], "inner_steps": inner_steps},
                                                                  {"pipelines": [1], "inner_steps": inner_steps}]}},
    }


def speed_model(name: str, layers: int | None) -> Any:
    """The preset `name` (a ModelSpec), cut to `layers` layers when given."""
    from flashflex_cli.model.spec import PRESETS

    model = PRESETS[name]
    if layers is None or layers == model.num_layers:
        return model
    return model.model_copy(update={"name": f"{name}-{layers}l", "num_layers": layers})


def write_plan(work: Path, name: str, fragment: dict[str, Any], cluster_path: Path, model: Any) -> Path:
    from flashflex_cli.hardware.cluster import load_cluster
    from flashflex_cli.plan.schema import Plan, save_plan

    cluster = load_cluster(cluster_path)
    data = {"schema": "flashflex.plan/1",
            "inputs": {"cluster_sha256": cluster.sha256(), "cluster_name": cluster.name,
                       "model": model.model_dump(mode="json"),
                       "train": {"global_batch": 2 * PER_DEVICE, "seq_len": SEQ_LEN, "dtype": "fp32"},
                       "strategy": "manual"}, **fragment}
    path = work / f"plan-{name.replace(' ', '-')}.json"
    save_plan(path, Plan.model_validate(data))
    return path


def tx_bytes(net: Any) -> int:
    """Bytes sent so far by every namespace host's interface."""
    total = 0
    for i, host in enumerate(net.hosts):
        done = subprocess.run([*net.prefix_cmd(i), "cat", f"/sys/class/net/{host.ifname}/statistics/tx_bytes"],
                              capture_output=True, text=True, check=True, timeout=30)
        total += int(done.stdout.strip())
    return total


def launch(net: Any, plan: Path, cluster: Path, out: Path, steps: int, run_id: str, port: int,
           nodes: int) -> dict[str, float]:
    """Render and run the plan's torchrun lines, line i in host i (a plan on `nodes` nodes runs on the first
    `nodes` hosts)."""
    hosts = net.hosts[:nodes]
    rendered = run([FLASHFLEX, "launch", str(plan), "--cluster", str(cluster), "--steps", str(steps),
                    "--out", str(out), "--launcher", "torchrun", "--hosts", ",".join(h.addr for h in hosts),
                    "--ifname", ",".join(h.ifname for h in hosts), "--run-id", run_id, "--port", str(port),
                    "--timeout", "300", "--torchrun", str(BIN / "torchrun"), "--overwrite", "--no-checkpoint"])
    lines = [x for x in rendered.stdout.splitlines() if x.strip() and not x.startswith("#")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = tx_bytes(net)
    with usage() as figures:
        run_all([([*net.prefix_cmd(i), "bash", "-c", line], env) for i, line in enumerate(lines)], TIMEOUT_S)
    figures["link_bytes"] = float(tx_bytes(net) - before)
    return figures


def rows_of(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def speed(args: argparse.Namespace, work: Path, inner_steps: int | None) -> tuple[float, list[str]]:
    """Part (B); returns (local / best synchronous tokens/s, report lines)."""
    from tests.infra.netns import NetnsHosts, netns_available

    from flashflex_cli.cost.outer_sync import round_estimate
    from flashflex_cli.cost.params import CostParams
    from flashflex_cli.hardware.cluster import load_cluster
    from flashflex_cli.layers.load import load_layer_profiles
    from flashflex_cli.plan.schema import load_plan

    ok, why = netns_available(PREFIX)
    if not ok:
        return float("nan"), [f"speed: skipped ({why})"]
    h = inner_steps or 16
    rounds = max(3, args.speed_rounds)
    cluster = work / "cluster-speed.json"
    run([FLASHFLEX, "profile", "--synthetic", f"2x1xcpu:slowdown=1:bw={gbit(args.rate):g}", "--out", str(cluster),
         "--name", f"netns-{args.rate}"])
    model = speed_model(args.speed_model, args.speed_layers)
    plans = {name: write_plan(work, name, fragment, cluster, model)
             for name, fragment in layouts(model.num_layers, h).items()}
    lines: list[str] = []
    measured: dict[str, dict[str, Any]] = {}
    port = 29600 + os.getpid() % 200
    collected: dict[str, dict[str, Any]] = {}
    repeat_ratios: list[float] = []
    with NetnsHosts(2, shape={0: args.rate, 1: args.rate}, prefix=PREFIX) as net:
        for repeat in range(args.speed_repeats):  # every layout once per repeat, the order reversed each time
            order = list(plans) if repeat % 2 == 0 else list(reversed(plans))
            this: dict[str, float] = {}
            for name in order:
                steps = h * rounds if name == "local sync" else args.speed_steps
                out = work / f"speed-{name.replace(' ', '-')}-{repeat}"
                port += 1
                try:
                    figures = launch(net, plans[name], cluster, out, steps, f"ffL-{port}", port,
                                     1 if name == "one device" else 2)
                except CommandFailed as exc:
                    lines.append(f"speed {name}: failed: {str(exc).splitlines()[0]}")
                    print(lines[-1], flush=True)
                    continue
                rows = rows_of(out)[1:]  # the first step (round) pays for warm-up
                tokens = sum(r["tokens"] for r in rows_of(out))
                got = collected.setdefault(name, {"rows": [], "bytes": 0.0, "tokens": 0, "out": out, "runs": []})
                got["rows"] += rows
                got["bytes"] += figures["link_bytes"]
                got["tokens"] += tokens
                got["runs"].append(figures)
                if name == "one device":
                    got["out"] = out
                this[name] = statistics.median(r["tokens_per_s"] for r in rows)
                lines.append(f"speed run {repeat + 1} {name:<13}: {this[name]:8,.0f} tokens/s (median of {len(rows)} "
                             f"{'rounds' if name == 'local sync' else 'steps'}), "
                             f"{figures['link_bytes'] / tokens:9,.1f} bytes/token on the link | wall "
                             f"{figures['wall_s']:.0f} s, CPU {figures['cpu_s']:.0f} s, load "
                             f"{figures['load_before']:.1f}->{figures['load_after']:.1f}")
                print(lines[-1], flush=True)
            if "local sync" in this and len(this) > 1:
                repeat_ratios.append(this["local sync"] / max(v for k, v in this.items() if k != "local sync"))
    for name, got in collected.items():
        measured[name] = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in got["rows"]),
                          "step_s": [r["step_time_s"] for r in got["rows"]],
                          "bytes_per_token": got["bytes"] / got["tokens"], "out": got["out"]}
        lines.append(f"speed {name:<13}: {measured[name]['tokens_per_s']:8,.0f} tokens/s (median of "
                     f"{len(got['rows'])} {'rounds' if name == 'local sync' else 'steps'} over "
                     f"{len(got['runs'])} runs), {measured[name]['bytes_per_token']:9,.1f} bytes/token on the link")
        print(lines[-1], flush=True)
    if repeat_ratios:
        lines.append("speed: local / best synchronous per run: " + ", ".join(f"{r:.2f}x" for r in repeat_ratios)
                     + " (this shared host's run-to-run spread)")
        print(lines[-1], flush=True)
    sync = {k: v for k, v in measured.items() if k != "local sync"}
    if "local sync" not in measured or not sync:
        return float("nan"), lines
    best = max(sync, key=lambda k: sync[k]["tokens_per_s"])
    local = measured["local sync"]
    ratio = local["tokens_per_s"] / sync[best]["tokens_per_s"]
    lines.append(f"speed: local sync (H={h}, every device) / best synchronous ({best}): {ratio:.2f}x tokens/s "
                 f"(target >= 1.5x: {'met' if ratio >= 1.5 else 'missed'}); bytes on the link "
                 f"{sync[best]['bytes_per_token'] / max(local['bytes_per_token'], 1e-9):,.1f}x fewer per token")
    # the round time: the cost model with the compute calibrated by the one-device run (the device's compute
    # alone; the data-parallel run's stage times also hold the interference of its overlapped reduction)
    if "one device" in measured:
        layers = work / "calibrated.layers.json"
        try:
            run([FLASHFLEX, "calibrate", str(measured["one device"]["out"]), "--out", str(layers)])
            params = CostParams().with_layer_profiles(load_layer_profiles([layers]))
            predicted = round_estimate(load_plan(plans["local sync"]), load_cluster(cluster), params)
            times = local["step_s"]
            median = statistics.median(times)
            spread = (max(times) - min(times)) / median if len(times) > 1 else 0.0
            error = (predicted.round_s - median) / median
            lines.append(f"speed: round time measured {median:.2f} s (median of {len(times)}; run-to-run spread "
                         f"{spread * 100:.0f}% max-min), predicted {predicted.round_s:.2f} s (inner "
                         f"{predicted.inner_s:.2f} s + outer all-reduce {predicted.outer_s:.2f} s): {error * 100:+.0f}% "
                         f"(target within 15%, or within the spread where larger: "
                         f"{'met' if abs(error) <= max(0.15, spread) else 'missed'})")
        except (CommandFailed, OSError, ValueError) as exc:
            lines.append(f"speed: no prediction ({str(exc).splitlines()[0]})")
    for line in lines[-2:]:
        print(line, flush=True)
    return ratio, lines

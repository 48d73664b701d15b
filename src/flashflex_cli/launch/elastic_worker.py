"""The per-process entry point of a rendered elastic torchrun job (`flashflex launch --elastic --launcher
torchrun`): settle the plan of this rendezvous round, then run `runtime.worker` under it.

torch elastic restarts every host's workers after a failure, with a new rendezvous that admits the hosts still
there (`--nnodes=MIN:MAX`, `--max-restarts=N`). In each round, local rank 0 of every host writes its plan
node name into the agent's store. Global rank 0 then reads the GROUP_WORLD_SIZE names. On the first round
with every node present it keeps the launched plan; otherwise it writes the launched cluster restricted to the
present nodes and a new plan for it (the planner: same model, training configuration, strategy and seed) into
RUN/elastic/ on the shared folder, appends an event to RUN/events.jsonl and publishes the plan's path in the
store. The other processes wait for that path. A process whose node's devices the plan leaves unused exits 0.
Every round after the first resumes from the newest checkpoint.

Limits: the host serving the rendezvous (the first host) must survive; all hosts must see RUN and the
checkpoint folder at the same paths (a shared file system).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

STORE_PREFIX = "flashflex/elastic"


def _args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="flashflex-elastic-worker", add_help=False)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan-node", dest="node", required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--resume", action="store_true")
    known, _ = parser.parse_known_args(argv)
    return known, argv


def _store(timeout_s: float):  # type: ignore[no-untyped-def]
    """The torch elastic agent's store (MASTER_ADDR / MASTER_PORT), under a key prefix of this round."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                          timeout=timedelta(seconds=timeout_s))
    round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"{STORE_PREFIX}/{round_}", store)


def settle_plan(args: argparse.Namespace) -> tuple[str, str]:
    """(plan path, cluster path) of this round (module docstring)."""
    store = _store(max(args.timeout, 60.0))
    hosts = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if os.environ.get("LOCAL_RANK", "0") == "0":
        store.set(f"node/{os.environ.get('GROUP_RANK', '0')}", args.node)
    if os.environ.get("RANK", "0") == "0":
        present = [store.get(f"node/{i}").decode() for i in range(hosts)]
        decided = _decide(args, present, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        store.set("plan", json.dumps(decided))
    plan_path, cluster_path = json.loads(store.get("plan").decode())
    return plan_path, cluster_path


def _decide(args: argparse.Namespace, present: list[str], round_: int) -> list[str]:
    """Global rank 0: the plan of this round for the plan nodes `present`."""
    from ..cost.params import CostParams
    from ..fileio import atomic_write_text
    from ..hardware.cluster import Cluster, load_cluster
    from ..plan.schema import load_plan
    from .elastic import append_event, latest_step, predicted_tokens_per_s, replan

    plan, cluster = load_plan(args.plan), load_cluster(args.cluster)
    used = sorted({info.device.rpartition("/")[0] for info in plan.ranks()})
    if round_ == 0 and set(used) <= set(present):
        return [args.plan, args.cluster]
    data = cluster.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["nodes"] = [node for node in data["nodes"] if node["name"] in present]
    inter = data.get("inter_node", {})
    inter["pairs"] = [p for p in inter.get("pairs", []) if p["a"] in present and p["b"] in present]
    data["inter_node"] = inter
    smaller = Cluster.model_validate(data)
    folder = os.path.join(args.out, "elastic")
    cluster_path = os.path.join(folder, f"cluster-round-{round_}.json")
    plan_path = os.path.join(folder, f"plan-round-{round_}.json")
    params = CostParams()
    new = replan(plan, smaller, cluster_path, params, 30.0)
    atomic_write_text(cluster_path, smaller.to_json())
    atomic_write_text(plan_path, new.to_json())
    lost = [d for d in cluster.device_ids if d.rpartition("/")[0] not in present]
    checkpoint_dir = _option(sys.argv[1:], "--checkpoint-dir")
    append_event(args.out, {"round": round_, "step": latest_step(checkpoint_dir), "reason": "hosts changed",
                            "present_nodes": present, "lost_devices": lost, "old_plan": args.plan,
                            "new_plan": plan_path, "old_cluster": args.cluster, "new_cluster": cluster_path,
                            "predicted_tokens_per_s_before": predicted_tokens_per_s(plan, cluster, params),
                            "predicted_tokens_per_s_after": (new.predicted or {}).get("tokens_per_s")})
    print(f"flashflex elastic: round {round_}: plan nodes {', '.join(present)} present; re-planned "
          f"{plan.world_size} -> {new.world_size} devices ({plan_path})", file=sys.stderr, flush=True)
    return [plan_path, cluster_path]


def _option(argv: list[str], name: str) -> str | None:
    """The value of `name` in `argv` (None when absent)."""
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else None


def _replace(argv: list[str], name: str, value: str) -> list[str]:
    """`argv` with the value of option `name` set to `value`."""
    out = list(argv)
    out[out.index(name) + 1] = value
    return out


def main(argv: list[str] | None = None) -> int:
    """Settle this round's plan, then run the worker under it (its exit code)."""
    from ..plan.schema import load_plan
    from ..runtime import worker

    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = _args(argv)
    try:
        plan_path, cluster_path = settle_plan(args)
    except Exception as exc:  # one line, like the worker's own failures
        print(f"flashflex elastic worker on {args.node}: cannot settle the plan: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return 1
    plan = load_plan(plan_path)
    mine = [info for info in plan.ranks() if info.device.rpartition("/")[0] == args.node]
    if int(os.environ.get("LOCAL_RANK", "0")) >= len(mine):
        print(f"flashflex elastic worker: {args.node} local rank {os.environ.get('LOCAL_RANK')} is unused by "
              f"{plan_path}; exiting", file=sys.stderr, flush=True)
        return 0
    os.environ["WORLD_SIZE"] = str(plan.world_size)
    argv = _replace(_replace(argv, "--plan", plan_path), "--cluster", cluster_path)
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and "--resume" not in argv:
        argv.append("--resume")
    return worker.main(argv)


if __name__ == "__main__":
    from ..runtime.worker import exit_now

    exit_now(main())

"""The per-process entry point of a rendered elastic torchrun job (`flashflex launch --elastic --launcher
torchrun`; arguments `--config RUN/config.json --plan-node NODE`, as the worker's): settle the plan of this
rendezvous round, then run `runtime.worker` under it.

torch elastic restarts every host's workers after a failure, with a new rendezvous that admits the hosts still
there (`--nnodes=MIN:MAX`, `--max-restarts=N`). In each round, local rank 0 of every host writes its plan
node name into the agent's store. Global rank 0 then reads the GROUP_WORLD_SIZE names. On the first round
with every node present it keeps the launched plan; otherwise it writes the launched cluster restricted to the
present nodes, a new plan for it (the planner: same model, training configuration, strategy and seed) and the
run configuration with that plan and cluster (resume on in every round after the first: they resume from the
newest checkpoint) into RUN/elastic/ on the shared folder, appends an event to RUN/events.jsonl and publishes
the configuration's path in the store. A plan of replica groups whose absent hosts held whole groups keeps the
other groups as they were, a group lost in part is re-planned in replica groups where the rounds fit the run
(launch/elastic.plan_after_loss, as the local elastic loop decides). The other processes wait for that path. A
process whose node's devices the plan leaves unused exits 0.

Limits: the host serving the rendezvous (the first host) must survive; all hosts must see RUN and the
checkpoint folder at the same paths (a shared file system).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from ..semantics.worker_protocol import say

if TYPE_CHECKING:
    from ..run_config import RunConfig

STORE_PREFIX = "flashflex/elastic"


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flashflex-elastic-worker", allow_abbrev=False)
    parser.add_argument("--config", required=True)
    parser.add_argument("--plan-node", dest="node", required=True)
    return parser.parse_args(argv)


def _store(timeout_s: float):  # type: ignore[no-untyped-def]
    """The torch elastic agent's store (MASTER_ADDR / MASTER_PORT), under a key prefix of this round."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                          timeout=timedelta(seconds=timeout_s))
    round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"{STORE_PREFIX}/{round_}", store)


def settle_config(config: RunConfig, config_path: str, node: str) -> str:
    """The run configuration file of this round (module docstring)."""
    store = _store(max(config.timeout_s, 60.0))
    hosts = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if os.environ.get("LOCAL_RANK", "0") == "0":
        store.set(f"node/{os.environ.get('GROUP_RANK', '0')}", node)
    if os.environ.get("RANK", "0") == "0":
        present = [store.get(f"node/{i}").decode() for i in range(hosts)]
        store.set("config", decide_round(config, config_path, present,
                                    int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))))
    return store.get("config").decode()


def decide_round(config: RunConfig, config_path: str, present: list[str], round_: int) -> str:
    """Global rank 0: the run configuration of this round for the plan nodes `present`."""
    from ..cost.params import CostParams
    from ..fileio import atomic_write_text
    from ..hardware.cluster import Cluster, load_cluster
    from ..plan.schema import load_plan
    from .elastic import append_event, latest_step, plan_after_loss, predicted_tokens_per_s
    from .group_loss import RunSteps

    plan, cluster = load_plan(config.plan), load_cluster(config.cluster)
    used = sorted({info.device.rpartition("/")[0] for info in plan.ranks()})
    if round_ == 0 and set(used) <= set(present):
        return config_path
    data = cluster.model_dump(mode="json", by_alias=True, exclude_none=True)
    data["nodes"] = [node for node in data["nodes"] if node["name"] in present]
    inter = data.get("inter_node", {})
    inter["pairs"] = [p for p in inter.get("pairs", []) if p["a"] in present and p["b"] in present]
    data["inter_node"] = inter
    smaller = Cluster.model_validate(data)
    folder = os.path.join(config.out, "elastic")
    cluster_path = os.path.join(folder, f"cluster-round-{round_}.json")
    plan_path = os.path.join(folder, f"plan-round-{round_}.json")
    params = CostParams()
    lost = [d for d in cluster.device_ids if d.rpartition("/")[0] not in present]
    step = latest_step(config.checkpoint_dir)
    new, groups = plan_after_loss(plan, lost, cluster, smaller, cluster_path, params, 30.0,
                                  RunSteps(config.steps, config.checkpoint_every, step))
    reason = "lost replica groups" if groups else "hosts changed"
    atomic_write_text(cluster_path, smaller.to_json())
    atomic_write_text(plan_path, new.to_json())
    # beside this round's plan: RUN/config.json stays the one the rendered script names
    round_config = dataclasses.replace(config, plan=plan_path, cluster=cluster_path,
                                       resume=config.resume or round_ > 0)
    written = os.path.join(folder, f"config-round-{round_}.json")
    atomic_write_text(written, round_config.to_json())
    append_event(config.out, {"round": round_, "step": step, "reason": reason,
                              "present_nodes": present, "lost_devices": lost, "lost_groups": groups,
                              "old_plan": config.plan,
                              "new_plan": plan_path, "old_cluster": config.cluster, "new_cluster": cluster_path,
                              "config": written,
                              "predicted_tokens_per_s_before": predicted_tokens_per_s(plan, cluster, params),
                              "predicted_tokens_per_s_after": new.predicted.tokens_per_s if new.predicted else None})
    what = (f"replica group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))} left out, the others as "
            "they were:" if groups else "re-planned")
    say(f"flashflex elastic: round {round_}: plan nodes {', '.join(present)} present; {what} "
        f"{plan.world_size} -> {new.world_size} devices ({plan_path})")
    return written


def main(argv: list[str] | None = None) -> int:
    """Settle this round's run configuration, then run the worker under it (its exit code)."""
    from ..plan.schema import load_plan
    from ..run_config import load_run_config
    from ..runtime.training import worker

    args = _args(list(sys.argv[1:] if argv is None else argv))
    try:
        config_path = settle_config(load_run_config(args.config), args.config, args.node)
        config = load_run_config(config_path)
    except Exception as exc:  # one line, like the worker's own failures
        say(f"flashflex elastic worker on {args.node}: cannot settle the plan: {type(exc).__name__}: {exc}")
        return 1
    plan = load_plan(config.plan)
    mine = [info for info in plan.ranks() if info.device.rpartition("/")[0] == args.node]
    if int(os.environ.get("LOCAL_RANK", "0")) >= len(mine):
        say(f"flashflex elastic worker: {args.node} local rank {os.environ.get('LOCAL_RANK')} is unused by "
            f"{config.plan}; exiting")
        return 0
    os.environ["WORLD_SIZE"] = str(plan.world_size)
    return worker.main(["--config", config_path, "--plan-node", args.node])


if __name__ == "__main__":
    from ..runtime.training.worker import exit_now

    exit_now(main())

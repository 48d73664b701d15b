"""Launch every rank of a plan on this host through torch elastic (the machinery behind torchrun).

`elastic_launch` runs the agent in this process: a c10d rendezvous on a free local port, one worker
process per plan device (`python -m flashflex_cli.runtime.worker ...`), no restarts. When a worker dies
the agent stops the others and we report which plan rank (node, device) failed.
"""

from __future__ import annotations

import inspect
import shlex
import sys
import uuid

from ..plan.schema import Plan
from .failures import Interrupted, describe_failure
from .options import WORKER_MODULE, RunOptions


def local_command(plan: Plan, options: RunOptions) -> list[str]:
    """The equivalent single-host torchrun command line (what `--dry-run` prints)."""
    return ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={plan.world_size}", "--max-restarts=0",
            "-m", WORKER_MODULE, *options.worker_argv()]


def launch_local(plan: Plan, options: RunOptions, monitor_interval_s: float = 0.1,
                 shutdown_timeout_s: int = 30) -> None:
    """Run the plan on this host; returns when every rank finished, raises RuntimeFailure when one failed.

    shutdown_timeout_s: seconds the agent waits for the other ranks after SIGTERM before SIGKILL.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    extra = {}
    if "shutdown_timeout" in inspect.signature(LaunchConfig).parameters:  # not in older torch releases
        extra["shutdown_timeout"] = shutdown_timeout_s
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=plan.world_size, run_id=f"flashflex-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"timeout": int(options.timeout_s)},
        max_restarts=0, monitor_interval=monitor_interval_s, start_method="spawn", **extra,
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", WORKER_MODULE, *options.worker_argv())
    except ChildFailedError as exc:
        raise describe_failure(plan, None, exc.failures) from None
    except SignalException as exc:
        saved = f"; checkpoint in {options.checkpoint_dir}" if options.checkpoint_dir else ""
        raise Interrupted(f"stopped by {exc.sigval.name}: the ranks finished their step{saved}",
                          128 + int(exc.sigval)) from None


def dry_run_text(plan: Plan, options: RunOptions) -> str:
    """Shell text of the single-host command."""
    return shlex.join(local_command(plan, options))

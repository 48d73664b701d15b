"""`flashflex launch --share-gpu`: every rank of a GPU plan on this machine's one GPU, a validation mode.

NCCL refuses two ranks on one GPU: it compares each rank's host hash and the GPU's bus id. Giving every rank its
own NCCL_HOSTID makes the ranks separate hosts to NCCL, so they talk over sockets on loopback, with NCCL's real
streams, `wait()` semantics, communicator splits, batched point-to-point operations and watchdog; public test
harnesses run several ranks per GPU this way. NVIDIA calls several ranks per GPU unsupported, so this is a way to
run multi-rank GPU plans on a one-GPU machine for checking (benchmarks/gpu_session.sh `ranks`), never a way to
train on a cluster: the ranks share the GPU's compute and memory, and their step times are not the plan's.

What changes: each worker drives cuda:0 (RunConfig.share_gpu; every other setting of the run is the same, the
same compile and memory paths), and its environment gets, per rank, NCCL_HOSTID (its own), NCCL_P2P_DISABLE=1
and NCCL_SHM_DISABLE=1 (no CUDA peer or shared-memory transport between "hosts"), NCCL_IB_DISABLE=1 and
NCCL_SOCKET_IFNAME=lo (sockets on loopback); a value the user set is kept, but for NCCL_HOSTID. Preflight checks
the summed prediction of all ranks against the one GPU. Refused (one line, exit 2, nothing started): a plan of
CPU devices, a launcher other than local, --elastic.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import InputError
from ..hardware.cluster import Cluster
from ..plan.schema import Plan

HOSTID_ENV = "NCCL_HOSTID"
# transports between the ranks' pretend hosts: sockets on loopback only
LOOPBACK_ENV: dict[str, str] = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                                "NCCL_SOCKET_IFNAME": "lo"}
CPU_TYPES = ("cpu", "host")


def share_gpu_env(local_rank: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables local rank `local_rank` adds to its environment in --share-gpu mode (module docstring)."""
    out = {name: value for name, value in LOOPBACK_ENV.items() if name not in environ}
    out[HOSTID_ENV] = f"flashflex-share-gpu-rank-{local_rank}"
    return out


def check_share_gpu(plan: Plan, cluster: Cluster, launcher: str, elastic: bool) -> None:
    """--share-gpu applies: a local, non-elastic launch of a plan whose devices are all GPUs (InputError)."""
    if launcher != "local":
        raise InputError(f"--share-gpu runs every rank on this machine's GPU: it needs --launcher local, got "
                         f"{launcher}")
    if elastic:
        raise InputError("--share-gpu is a validation mode and cannot be combined with --elastic")
    cpu = [info.device for info in plan.ranks() if cluster.device(info.device).type.lower() in CPU_TYPES]
    if cpu:
        raise InputError(f"--share-gpu needs a plan of GPUs; {cpu[0]} is an emulated CPU device "
                         f"({len(cpu)} of the plan's {plan.world_size} ranks)")

"""`flashflex launch --gpus 2,3`: run the plan's node on a subset of this host's GPUs, as accelerate's --gpu_ids
and Lightning's `devices=[...]` choose them.

The workers see only the listed GPUs, in the listed order (CUDA_VISIBLE_DEVICES), so plan device NODE/i runs on
the i-th listed GPU, or, where the cluster file records each GPU's UUID or PCI bus id, on the listed GPU with that
identity (hardware/gpu_identity.py): profile the same subset (`CUDA_VISIBLE_DEVICES=2,3 flashflex profile`) to
record theirs. Local launcher only: a SLURM allocation sets CUDA_VISIBLE_DEVICES itself, and a rendered torchrun
line runs in its host's own environment. Refused (one line, exit 2, nothing started): a plan of CPU devices,
--share-gpu, fewer GPUs than the plan runs on the node.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InputError
from ..hardware.cluster import Cluster
from ..hardware.gpu_identity import LocalGpu
from ..plan.schema import Plan

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
CPU_TYPES = ("cpu", "host")


def check_gpus(plan: Plan, cluster: Cluster, gpus: tuple[int, ...], launcher: str, share_gpu: bool) -> None:
    """--gpus applies to this launch (InputError naming why not)."""
    if launcher != "local":
        raise InputError(f"--gpus chooses this host's GPUs for a local launch; with --launcher {launcher} set "
                         f"{VISIBLE_ENV} on each host (SLURM sets it for its allocation)")
    if share_gpu:
        raise InputError("--gpus and --share-gpu contradict each other (--share-gpu runs every rank on cuda:0)")
    devices = [info.device for info in plan.ranks()]
    cpu = [d for d in devices if cluster.device(d).type.lower() in CPU_TYPES]
    if cpu:
        raise InputError(f"--gpus needs a plan of GPUs; {cpu[0]} is an emulated CPU device")
    indices = [int(d.rpartition("/")[2]) for d in devices]
    if max(indices) >= len(gpus):
        raise InputError(f"--gpus {','.join(map(str, gpus))} lists {len(gpus)} GPU(s); the plan runs device "
                         f"{devices[indices.index(max(indices))]} of its node, which needs at least {max(indices) + 1}")


def gpus_env(gpus: tuple[int, ...] | None) -> dict[str, str]:
    """The workers' CUDA_VISIBLE_DEVICES for --gpus (nothing without it)."""
    return {VISIBLE_ENV: ",".join(map(str, gpus))} if gpus else {}


def listed_gpus(visible: Sequence[LocalGpu], gpus: tuple[int, ...]) -> list[LocalGpu]:
    """What a worker started with --gpus sees, from the launcher's own view `visible`: the listed GPUs numbered
    from 0 in the listed order (InputError when one is not there)."""
    by_ordinal = {gpu.ordinal: gpu for gpu in visible}
    missing = [g for g in gpus if g not in by_ordinal]
    if missing:
        raise InputError(f"--gpus {','.join(map(str, gpus))}: this host has no GPU {missing[0]} "
                         f"({len(visible)} visible)")
    return [LocalGpu(i, by_ordinal[g].uuid, by_ordinal[g].bus_id) for i, g in enumerate(gpus)]

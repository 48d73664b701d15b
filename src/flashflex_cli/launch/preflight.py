"""Checks before any process starts: the plan against its cluster, this machine, the model, the data.

Each check raises a FlashflexError with one line naming what does not match; warnings are returned.
A plan that does not match the machine it is launched on is a failed check (exit code 1); unreadable
or inconsistent inputs are input errors (exit code 2).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data.checks import check_training_data
from ..errors import CheckFailed, InputError
from ..fileio import check_writable_dir
from ..hardware.cluster import Cluster
from ..hardware.gpu_identity import cuda_ordinal, visible_gpus
from ..model.flops import total_params
from ..plan.schema import Plan
from ..semantics.outer_sync import group_inner_steps
from ..semantics.runtime_paths import RuntimeOptions
from ..units import byte_size
from .gpu_subset import listed_gpus
from .layout import node_layouts

if TYPE_CHECKING:
    from ..run_config import RunConfig
    from ..semantics.run_folder import StartDecision

CHECKPOINT_BYTES_PER_PARAM = 16  # fp32 weights and two AdamW moments (12 bytes), plus headroom
PROCESS_OVERHEAD_BYTES = 400 * 1024**2  # a Python process with torch imported, measured ~350 MiB on CPU


@dataclass
class Preflight:
    """What the checks found: warnings for humans, and the estimated bytes each rank needs."""

    warnings: list[str] = field(default_factory=list)
    rank_bytes: list[float] = field(default_factory=list)


def is_cpu_device(cluster: Cluster, device: str) -> bool:
    """True for an emulated CPU device (type "cpu" or "host")."""
    return cluster.device(device).type.lower() in ("cpu", "host")


def check_plan_cluster(plan: Plan, cluster: Cluster, cluster_path: str) -> None:
    """The cluster file is the one the plan was made for, and holds every device the plan uses."""
    if plan.inputs.cluster_sha256 != cluster.sha256():
        raise CheckFailed(
            f"{cluster_path} is not the cluster this plan was made for (sha256 {cluster.sha256()[:12]}..., the "
            f"plan expects {plan.inputs.cluster_sha256[:12]}... of cluster {plan.inputs.cluster_name!r}); "
            "re-plan for this cluster with `flashflex plan`")
    known = set(cluster.device_ids)
    for info in plan.ranks():
        if info.device not in known:
            raise CheckFailed(f"plan rank {info.rank} uses device {info.device}, absent from {cluster_path}")


def rank_memory_bytes(plan: Plan, cluster: Cluster, runtime: RuntimeOptions | None = None) -> list[float]:
    """Bytes each rank needs at its peak, as the cost model predicts its stage (cost/memory.py: the allocated
    peak, the allocator's slack and what lives outside it), for the runtime paths the launch takes."""
    from ..cost.estimate import plan_memory
    from ..cost.params import CostParams

    runtime = runtime or RuntimeOptions()
    params = CostParams().for_launch(runtime)
    stages = plan_memory(plan, cluster, params)
    return [stages[(info.pipeline, info.stage)].total for info in plan.ranks()]


def _available_host_bytes() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_local_machine(plan: Plan, cluster: Cluster, runtime: RuntimeOptions | None = None,
                        share_gpu: bool = False, gpus: tuple[int, ...] | None = None) -> Preflight:
    """This machine can run every rank of the plan: CPU-emulated plans run all nodes here; GPU plans
    need one node whose devices exist here with enough memory (the cost model's prediction of each stage, for
    the runtime paths `runtime`); with `share_gpu` (launch/share_gpu.py) every rank of a GPU plan, whatever its
    nodes, on this machine's first GPU, which must hold all their predictions together; with `gpus`
    (launch/gpu_subset.py) the node's devices among those GPUs, as the workers will see them."""
    import torch

    report = Preflight(rank_bytes=rank_memory_bytes(plan, cluster, runtime))
    if share_gpu:
        return _check_shared_gpu(plan, report)
    ranks = plan.ranks()
    gpu_ranks = [info for info in ranks if not is_cpu_device(cluster, info.device)]
    if gpu_ranks and len(gpu_ranks) != len(ranks):
        raise CheckFailed("the plan mixes emulated CPU devices and GPUs; launch it with --launcher torchrun or slurm")
    if not gpu_ranks:
        need = sum(report.rank_bytes) + PROCESS_OVERHEAD_BYTES * len(ranks)
        have = _available_host_bytes()
        if have is not None and need > have:
            raise CheckFailed(f"the plan's {len(ranks)} CPU ranks need about {byte_size(need)}, this machine "
                              f"has {byte_size(have)} available")
        if (line := core_share_warning(plan, cluster)) is not None:
            report.warnings.append(line)
        return report
    layouts = node_layouts(plan, cluster)
    if len(layouts) > 1:
        raise CheckFailed(f"the plan spans {len(layouts)} GPU nodes ({', '.join(x.name for x in layouts)}); a "
                          "local launch runs one: use --launcher torchrun or --launcher slurm")
    if not torch.cuda.is_available():
        raise CheckFailed(f"the plan wants {len(gpu_ranks)} GPUs ({gpu_ranks[0].device}, ...) and this machine "
                          "has no CUDA device")
    visible = visible_gpus()
    physical = [gpu.ordinal for gpu in visible]  # a worker's ordinal -> this process's (they differ with --gpus)
    if gpus:
        try:
            visible, physical = listed_gpus(visible, gpus), list(gpus)
        except InputError as exc:
            raise CheckFailed(str(exc)) from None
    for info in gpu_ranks:
        recorded = cluster.device(info.device)
        try:
            index = cuda_ordinal(info.device, recorded.uuid, recorded.pci_bus_id, int(info.device.rpartition("/")[2]),
                                 visible)
        except InputError as exc:
            raise CheckFailed(f"plan rank {info.rank}: {exc}") from None
        have = torch.cuda.get_device_properties(physical[index]).total_memory
        need = report.rank_bytes[info.rank]
        if need > have:
            raise CheckFailed(f"plan rank {info.rank} on cuda:{index} needs about {byte_size(need)}, the GPU "
                              f"has {byte_size(have)}")
        wanted = cluster.device(info.device).type
        actual = torch.cuda.get_device_name(physical[index])
        if wanted.split("-")[0].lower() not in actual.lower():
            report.warnings.append(f"{info.device} is a {wanted} in the cluster file, cuda:{index} is a {actual}")
    return report


def core_share_warning(plan: Plan, cluster: Cluster, cores: list[int] | None = None) -> str | None:
    """One line when the plan's emulated CPU devices need more of some host core than it has: each device is
    pinned to one core (hardware/cpu_share.py) and computes 1/slowdown of the time, so a core whose devices add
    up to more than 1 runs them that many times slower than the plan predicts. None when every core suffices."""
    from ..hardware.cpu_share import core_loads, usable_cores

    found = cores if cores is not None else usable_cores()
    devices = [info.device for info in plan.ranks()]
    loads = core_loads([(cluster.device_ids.index(d), cluster.device(d).slowdown) for d in devices], found)
    worst = max(loads.values(), default=0.0)
    if worst <= 1.0:
        return None
    need = sum(loads.values())
    return (f"the plan's {len(devices)} emulated devices need {need:.1f} cores' worth of compute at their slowdowns "
            f"(the sum of 1/slowdown), this host gives them {len(found)}: the busiest core carries {worst:.1f}, so "
            f"expect steps up to {worst:.1f}x slower than predicted; emulate fewer devices or larger slowdowns "
            "(`flashflex profile --synthetic \"1xNxcpu:slowdown=...\"`)")


def _check_shared_gpu(plan: Plan, report: Preflight) -> Preflight:
    """--share-gpu: cuda:0 exists and holds every rank's predicted total (each rank a process with its own CUDA
    context, allocator and communicators)."""
    import torch

    if not torch.cuda.is_available():
        raise CheckFailed(f"--share-gpu runs the plan's {plan.world_size} ranks on this machine's GPU, and it has "
                          "no CUDA device")
    have = torch.cuda.get_device_properties(0).total_memory
    need = sum(report.rank_bytes)
    if need > have:
        raise CheckFailed(f"--share-gpu: the plan's {plan.world_size} ranks need about {byte_size(need)} together "
                          f"(the cost model's prediction of each), cuda:0 has {byte_size(have)}")
    report.warnings.append(f"--share-gpu: {plan.world_size} ranks share cuda:0 ({torch.cuda.get_device_name(0)}), "
                           "a validation mode: their step times are not the plan's")
    return report


def check_run(plan: Plan, data: str, steps: int, checkpoint_dir: str | None, checkpoint_every: int,
              resume: bool, schedule_steps: int | None = None) -> list[str]:
    """The model, training configuration, data and checkpoint options fit together; returns warnings.

    Numbers (steps, seed, ...) are range-checked by RunConfig (run_config.py); token ids are scanned against the
    vocabulary."""
    warnings: list[str] = []
    if (checkpoint_every or resume) and not checkpoint_dir:
        raise InputError("--checkpoint-every and --resume need checkpoints (not --no-checkpoint)")
    train, model = plan.inputs.train, plan.inputs.model
    check_training_data(data, model.vocab_size, train.seq_len)
    stride = max(group_inner_steps(plan))  # a plan of replica groups runs whole rounds (semantics/outer_sync.py)
    if plan.outer_sync is not None and (steps % stride or checkpoint_every % stride):
        raise InputError(f"--steps {steps} and --checkpoint-every {checkpoint_every} must be whole numbers of rounds "
                         f"of {stride} inner steps (the plan's replica groups)")
    if resume and checkpoint_dir:
        from ..semantics.run_folder import latest_checkpoint, read_manifest

        found = latest_checkpoint(checkpoint_dir)
        if found is None:
            warnings.append(f"--resume: no checkpoint in {checkpoint_dir} yet, starting from step 0")
        else:
            manifest = _checked_manifest(found, read_manifest(found))
            if manifest["model"] != model.model_dump(mode="json"):
                raise CheckFailed(f"{found} holds model {manifest['model'].get('name')!r} of another shape than the "
                                  f"plan's {model.name!r}; resume needs the same model")
            if manifest["train"] != train.model_dump(mode="json"):
                warnings.append(f"{found} was trained with {manifest['train']}, the plan says "
                                f"{train.model_dump(mode='json')}: the loss trajectory will differ")
            schedule = schedule_steps or steps
            if manifest.get("steps", schedule) != schedule:
                warnings.append(f"{found} comes from a learning-rate schedule of {manifest['steps']} steps, this run's "
                                f"spans {schedule} (--schedule-steps, default --steps): the loss trajectory will differ")
    return warnings


def start_decision(plan: Plan, options: RunConfig, overwrite: bool) -> StartDecision:
    """Whether the launch continues the progress its run and checkpoint folders hold, starts again or is refused
    (InputError, one line naming --resume and --overwrite): semantics/run_folder.decide_start, with the identity
    the workers record in their checkpoints."""
    from ..semantics.run_folder import decide_start, folder_progress, run_identity

    identity = run_identity(plan_text=plan.to_json(), model=plan.inputs.model.model_dump(mode="json"),
                            train=plan.inputs.train.model_dump(mode="json"), data=options.data, seed=options.seed,
                            schedule_steps=options.optimizer.total_steps, lr=options.optimizer.lr,
                            init_from=options.init_from)
    return decide_start(folder_progress(options.out, options.checkpoint_dir), resume=options.resume,
                        overwrite=overwrite, steps=options.steps, identity=identity)


def check_init_from(plan: Plan, init_from: str | None, here: bool = True) -> list[str]:
    """--init-from names a Hugging Face checkpoint of the plan's model: config.json equal field by field, the
    safetensors files readable, every tensor present with its shape and a float dtype (headers only, hf/load.py).
    `here` False (rendered scripts for other hosts): a folder absent on this machine is a warning."""
    if init_from is None:
        return []
    if not here and not Path(init_from).exists():
        return [f"--init-from {init_from} is not on this machine: it was not checked"]
    from ..hf.load import check_checkpoint

    check_checkpoint(init_from, plan.inputs.model)
    return []


def _checked_manifest(found: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest fields a resume compares: model and train objects, step (and steps) integers."""
    for key, kind in (("model", dict), ("train", dict), ("step", int)):
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise InputError(f"{found}: checkpoint manifest field {key!r} is missing or not a {kind.__name__}")
    if "steps" in manifest and not isinstance(manifest["steps"], int):
        raise InputError(f"{found}: checkpoint manifest field 'steps' is not an integer")
    return manifest


def check_run_dirs(out: str, checkpoint_dir: str | None) -> None:
    """The run folder and the checkpoint folder can be created and written (before the plan is even read)."""
    check_writable_dir(out, "--out")
    if checkpoint_dir is not None:
        check_writable_dir(checkpoint_dir, "--checkpoint-dir")


def checkpoint_bytes(plan: Plan) -> int:
    """Estimated size of one checkpoint: every parameter with its AdamW moments, 16 bytes each."""
    return total_params(plan.inputs.model) * CHECKPOINT_BYTES_PER_PARAM


def check_checkpoint_space(plan: Plan, checkpoint_dir: str | None) -> None:
    """The file system of `checkpoint_dir` has room for at least one checkpoint."""
    if checkpoint_dir is None:
        return
    folder = Path(checkpoint_dir)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    need = checkpoint_bytes(plan)
    if need > free:
        raise CheckFailed(f"--checkpoint-dir {checkpoint_dir}: one checkpoint needs about {byte_size(need)} "
                          f"({total_params(plan.inputs.model):,} parameters x {CHECKPOINT_BYTES_PER_PARAM} bytes), "
                          f"{byte_size(free)} free there")

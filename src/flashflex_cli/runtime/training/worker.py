"""The per-rank entry point: `python -m flashflex_cli.runtime.training.worker --config RUN/config.json [--plan-node NODE]`.

Every setting of the run comes from the run configuration file (run_config.py), which the launcher wrote: the plan,
cluster, data, steps, checkpoints, the runtime switches, the optimizer and its schedule, the loss scaling.
Started by torch elastic (`flashflex launch`, torchrun, or SLURM's srun + torchrun), it reads LOCAL_RANK,
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment torchrun sets. Its plan rank comes from
(`--plan-node`, LOCAL_RANK): local rank i runs the i-th device of that plan node in plan rank order (without
`--plan-node`, every device of the plan runs on this host, and the plan rank is LOCAL_RANK). The process group
uses plan ranks (gloo on CPU devices, NCCL on GPUs) over torchrun's store, so torchrun's own rank order
does not matter. A rank on an emulated CPU device runs one intra-op thread pinned to one core
(hardware/cpu_share.py), whatever OMP_NUM_THREADS says.

Exit codes: 0 done (or stopped by SIGTERM / SIGINT after saving a checkpoint); 1 an error on this rank;
3 a peer rank failed (a collective broke or timed out); 2 bad input; 128 + N a stop signal N before training.
Signals: SIGTERM and SIGINT before training began end the process quietly; during training they stop it at
the next step boundary, with a checkpoint (repeats are ignored: the launcher escalates with SIGKILL).
Started by `flashflex launch` (local), it also dies with the launcher, beats a heartbeat the launcher watches
and leaves its one-line error for the launcher's report (runtime/training/heartbeat.py).
Fault injection for tests: FLASHFLEX_FAULT_INJECT="rank=R,step=K" kills plan rank R with SIGKILL at the
start of step K; FLASHFLEX_OOM_INJECT="rank=R,phase=P,step=K" raises an out-of-memory there (runtime/device/oom.py);
FLASHFLEX_OVERFLOW_INJECT="rank=R,step=K" makes plan rank R's gradient inf at step K of an fp16 plan
(runtime/training/loss_scale.py: every rank skips that step); FLASHFLEX_DELAY_INJECT="rank=R,seconds=S[,step=K]" makes
plan rank R sleep S seconds in its set-up (without step) or at the start of step K (`injected_delay`).
Collective timeouts (runtime/parallel/timeouts.py): the long one (RunConfig.setup_seconds) from joining the process group
to the end of the first step and around every checkpoint save, `--timeout` for the other steps.
An out-of-memory is one line (runtime/device/oom.py: rank, device, stage, phase, bytes, the plan's prediction, what
to change) and exit code 1. On GPUs NCCL sets up its communicators at process-group init (`device_id`), so
its buffers are taken before the model's tensors.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, NoReturn

from ...hardware.cpu_share import pin_emulated_device, usable_cores
from ...semantics import flight_recorder
from ...semantics.worker_protocol import PEER_LOST, parse_injection, say
from ..device import oom
from ..device.oom_injection import injection_from_env
from . import heartbeat

if TYPE_CHECKING:
    from ...hardware.cluster import Cluster, Device
    from ...run_config import RunConfig



def plan_rank(plan, node: str | None, local_rank: int) -> int:  # type: ignore[no-untyped-def]
    """The plan rank of local rank `local_rank` on plan node `node` (None: all nodes on this host)."""
    ranks = [info.rank for info in plan.ranks() if node is None or info.device.rpartition("/")[0] == node]
    if not ranks:
        raise ValueError(f"plan node {node!r} runs no device of the plan")
    if local_rank >= len(ranks):
        raise ValueError(f"local rank {local_rank} but plan node {node!r} runs only {len(ranks)} devices")
    return ranks[local_rank]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """`--config PATH` (the run configuration) and `--plan-node NODE` (dest `node`; default: every node)."""
    parser = argparse.ArgumentParser(prog="flashflex-worker", description=__doc__.splitlines()[0],
                                     allow_abbrev=False)  # an old `--plan P` is refused, not taken as --plan-node
    parser.add_argument("--config", required=True, help="the run configuration, RUN/config.json (run_config.py)")
    parser.add_argument("--plan-node", dest="node", help="plan node run by this host (default: all)")
    return parser.parse_args(argv)


DELAY_ENV = "FLASHFLEX_DELAY_INJECT"
FAULT_ENV = "FLASHFLEX_FAULT_INJECT"


def injected_delay(env: Mapping[str, str], rank: int, step: int | None) -> float:
    """Seconds FLASHFLEX_DELAY_INJECT asks plan rank `rank` to sleep at the start of step `step` (None: in its
    set-up, before the stage is built): "rank=R,seconds=S[,step=K]", several joined by ";"."""
    total = 0.0
    for text in filter(None, (part.strip() for part in env.get(DELAY_ENV, "").split(";"))):
        fields = parse_injection(DELAY_ENV, text, ("rank", "seconds", "step"), ("rank", "seconds"))
        if fields["rank"] == rank and fields.get("step") == step:
            total += float(fields["seconds"])
    return total


def _delay(rank: int, step: int | None) -> None:
    seconds = injected_delay(os.environ, rank, step)
    if seconds > 0:
        where = "in set-up" if step is None else f"at step {step}"
        say(f"flashflex: delay injection: rank {rank} waits {seconds:g} s {where}")
        time.sleep(seconds)


def _fault(rank: int, step: int) -> None:
    """Kill this process with SIGKILL where FLASHFLEX_FAULT_INJECT="rank=R,step=K" asks (plan rank R, step K)."""
    spec = os.environ.get(FAULT_ENV, "").strip()
    if not spec:
        return
    fields = parse_injection(FAULT_ENV, spec, ("rank", "step"), ("rank", "step"))
    if fields["rank"] == rank and fields["step"] == step:
        say(f"flashflex: fault injection: killing rank {rank} at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _exit_quietly(signum: int, _frame: object) -> None:
    """A stop signal before training: nothing to save, no traceback."""
    os._exit(128 + signum)


def exit_quietly_on_stop_signals() -> None:
    """Until StopRequest takes over, SIGTERM and SIGINT end the process at once and quietly."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _exit_quietly)


class StopRequest:
    """Installs SIGTERM and SIGINT handlers: the first signal asks to stop after the current step (every rank
    agrees through an all-reduce, then all save); repeats are ignored (scancel, systemd and Ctrl-C reach every
    process and the launcher passes the signal on too; it escalates with SIGKILL after its grace period)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = "SIGTERM"
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
        self.requested = True


def host_device_index(cluster: Cluster, device_id: str, node: str | None = None) -> int:
    """The index that picks an emulated device's core: its position among all the cluster's devices. A
    node's devices are consecutive there, so they get distinct cores as its index on the node would, and
    nodes emulated on one machine (network-namespace hosts, or one host running every node) do not all
    crowd onto the first cores. `node` (the host's plan node) is accepted for the call sites' symmetry."""
    del node
    return cluster.device_ids.index(device_id)


def gpu_rank_threads(local_world_size: int, cores: int | None = None) -> int:
    """Host intra-op threads (count) for each of `local_world_size` GPU ranks sharing `cores` (default: usable)."""
    available = cores if cores is not None else len(usable_cores())
    return max(1, available // max(1, local_world_size))


def claim_host_share(on_cpu: bool, device_index: int) -> None:
    """Set this rank's host threads; call before any parallel torch work.

    Emulated CPU device (`device_index`: see host_device_index): one intra-op thread pinned to one core
    (hardware/cpu_share.py), even when OMP_NUM_THREADS is set, since the device model is one core per device.
    GPU rank: unless OMP_NUM_THREADS is set, the host's cores are split between the LOCAL_WORLD_SIZE ranks.
    """
    import torch

    if on_cpu:
        pin_emulated_device(device_index)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(gpu_rank_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def local_cuda_ordinal(device_id: str, recorded: Device) -> int:
    """The visible CUDA ordinal of plan device `device_id` (hardware/gpu_identity.py: by the UUID or PCI bus id
    the cluster file records, else by its index on the node). InputError naming the device when it is not here."""
    from ...hardware.gpu_identity import cuda_ordinal, visible_gpus

    return cuda_ordinal(device_id, recorded.uuid, recorded.pci_bus_id, int(device_id.rpartition("/")[2]),
                        visible_gpus())


def _init_process_group(rank: int, world: int, backend: str, timeout_s: float,  # type: ignore[no-untyped-def]
                        device_id=None):
    """Join the job's process group as plan rank `rank` over the store torchrun's agent provides; with
    `device_id` (a CUDA torch.device) NCCL forms its communicator now rather than at the first collective."""
    import torch.distributed as dist

    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"{' and '.join(missing)} not set: start workers through `flashflex launch`, torchrun "
                           "or a rendered SLURM script")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        store = dist.TCPStore(host, port, world, False, timeout=timeout)
        prefix = f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/flashflex"
    else:
        is_server = os.environ.get("RANK") == "0"
        store = dist.TCPStore(host, port, world, is_server, timeout=timeout)
        prefix = "flashflex"
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                            timeout=timeout, device_id=device_id)


def run(config: RunConfig, node: str | None = None, phases: oom.PhaseTracker | None = None) -> int:
    """Train with the settings `config` as plan node `node` (None: every node of the plan on this host); returns
    the exit code. `phases` is told where the rank is (for an out-of-memory's report)."""
    import torch
    import torch.distributed as dist

    from ...errors import InputError
    from ...fileio import atomic_write_text
    from ...hardware.cluster import load_cluster
    from ...model.flops import model_flops_per_token
    from ...plan.schema import load_plan
    from ...semantics.outer_sync import grouped, round_sequences
    from ...semantics.run_folder import decide_start, folder_progress, run_identity
    from ..checkpoint import dcp as ckpt
    from ..device.memory import held_memory_bytes, peak_since_reset, rank_memory_bytes
    from ..parallel.groups import build_groups
    from ..parallel.timeouts import PhasedTimeouts
    from .data import open_source, stage_tokens
    from .engine import RankEngine
    from .loss_scale import injected_steps
    from .metrics import (
        MetricsLog,
        predicted_step_seconds,
        run_summary,
        stage_ops,
        stage_times,
        write_timeline,
    )
    from .rounds import RoundTrainer

    started = time.monotonic()
    plan, cluster = load_plan(config.plan), load_cluster(config.cluster)
    if plan.inputs.cluster_sha256 != cluster.sha256():
        raise ValueError(f"{config.cluster} is not the cluster plan {config.plan} was made for (sha256 differs)")
    train, model = plan.inputs.train, plan.inputs.model
    # what this run's checkpoints record of it, and what an automatic resume must find equal
    manifest = run_identity(plan_text=plan.to_json(), model=model.model_dump(mode="json"),
                            train=train.model_dump(mode="json"), data=config.data, seed=config.seed,
                            schedule_steps=config.optimizer.total_steps, lr=config.optimizer.lr,
                            init_from=config.init_from)
    # continue, start or refuse by what the folders hold (the local launcher decided the same before starting
    # the workers; under torchrun or SLURM, a requeued job continues from its own checkpoints here)
    decision = decide_start(folder_progress(config.out, config.checkpoint_dir), resume=config.resume,
                            overwrite=False, steps=config.steps, identity=manifest)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    rank = plan_rank(plan, node, local_rank)
    world = plan.world_size
    if int(os.environ.get("WORLD_SIZE", world)) != world:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes, the plan has {world} ranks")
    ranks = plan.ranks()
    me = ranks[rank]
    os.environ["FLASHFLEX_RANK_LABEL"] = f"rank {rank} (node {me.device.rpartition('/')[0]}, device {me.device})"
    device_info = cluster.device(me.device)
    on_cpu = device_info.type.lower() in ("cpu", "host")
    if on_cpu:
        device = torch.device("cpu")
    elif config.share_gpu:  # every rank on the first GPU, NCCL told they are separate hosts (launch/share_gpu.py)
        if torch.cuda.device_count() < 1:
            raise ValueError(f"plan rank {rank}: --share-gpu, and this host has no CUDA device")
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cuda", local_cuda_ordinal(me.device, device_info))
    if not on_cpu:
        torch.cuda.set_device(device)
    phases = phases or oom.PhaseTracker()
    phases.attach(oom.stage_place(plan, rank), device, injection_from_env(os.environ))
    claim_host_share(on_cpu, host_device_index(cluster, me.device, node))
    if not on_cpu:  # the watchdog's dump on a timeout, in RUN/nccl-trace/ (before the process group exists)
        flight_recorder.prepare(config.out)
    phases.enter("nccl")
    # the long timeout until the first step is done (runtime/parallel/timeouts.py), the run's own after it
    _init_process_group(rank, world, "gloo" if on_cpu else "nccl", config.setup_seconds, None if on_cpu else device)

    stop = StopRequest()
    groups = build_groups(plan, rank, timeout=timedelta(seconds=config.setup_seconds))
    timeouts = PhasedTimeouts(groups, config.setup_seconds, config.timeout_s, on_cpu)
    phases.enter("setup")
    _delay(rank, None)
    initial = None
    if config.init_from:
        from ...hf.load import SlicedLoader

        initial = SlicedLoader(config.init_from, model)
    engine = RankEngine(plan, rank, groups, device, config.optimizer, seed=config.seed,
                        slowdown=device_info.slowdown, initial=initial, options=config.runtime, phases=phases,
                        loss_scaling=config.loss_scaling, overflow_steps=injected_steps(os.environ, rank))
    if rank == 0 and engine.compile_seconds is not None:
        say(f"flashflex: compiled in {engine.compile_seconds:.1f} s (warm-up before step 0, in no step's time)")
    # a batch of the source is a round's data (semantics/outer_sync.py; without replica groups: one step's)
    source = open_source(config.data, model.vocab_size, round_sequences(plan), train.seq_len, seed=config.seed)
    trainer = RoundTrainer(engine, source) if grouped(plan) else None  # low-communication training in rounds
    stride = trainer.steps_per_round if trainer is not None else 1  # steps a round advances the run by
    if config.steps % stride:
        raise InputError(f"--steps {config.steps} is not a whole number of rounds of {stride} inner steps "
                         "(the plan's replica groups)")
    holder = trainer if trainer is not None else engine  # what checkpoints hold and resume
    shards = ckpt.shards_for(trainer.state_for_checkpoint(), engine.shard_specs(), rank) if trainer is not None \
        else engine.checkpoint_shards()

    start = 0
    found = ckpt.latest_checkpoint(config.checkpoint_dir) if decision.resume and config.checkpoint_dir else None
    if found is not None:
        # each rank reads only the saved pieces overlapping its own shards, whatever plan saved them
        holder.load_local(lambda targets: ckpt.load_into(found, targets))
        start = trainer.round * stride if trainer is not None else engine.step
        if rank == 0:
            scale = f" (loss scale {engine.scaler.state()['loss_scale'].item():g})" if engine.scaler else ""
            say(f"flashflex: resumed from {found} at step {start}{scale}")
    elif rank == 0 and decision.line:
        say(f"flashflex: {decision.line}")

    log = None
    if rank == 0:
        peak = sum(cluster.device(info.device).flops(train.dtype) for info in ranks)
        log = MetricsLog(config.out, config.steps, model_flops_per_token(model, train.seq_len), peak,
                         device_type=device.type, sinks=config.metrics, settings=json.loads(config.to_json()))
        # what `flashflex show --run` and `flashflex calibrate` read back next to metrics.jsonl
        atomic_write_text(os.path.join(config.out, "plan.json"), plan.to_json())
        atomic_write_text(os.path.join(config.out, "cluster.json"), cluster.to_json())
        # which runtime paths ran (the launch switches, resolved for the device): the cost model charges the
        # run by them (semantics/runtime_paths.py)
        record = engine.options.to_record(train.dtype)
        if engine.scaler is not None:
            record["loss_scaling"] = engine.scaler.config.to_record()
        if engine.compile_seconds is not None:
            record["compile_warmup_s"] = round(engine.compile_seconds, 3)
        atomic_write_text(os.path.join(config.out, "runtime.json"), json.dumps(record, indent=2, sort_keys=True) + "\n")
    timeline: list[dict] = []
    flag = torch.zeros(1, device=device)  # NCCL reduces only device tensors
    step = start
    held_before = held_memory_bytes(device.type)
    for step in range(start, config.steps, stride):
        _fault(rank, step)
        _delay(rank, step)
        phases.begin_step(step)
        t0 = time.perf_counter()
        tokens = train.tokens_per_step
        if trainer is not None:  # a round: the group's inner steps, then the outer step; the round's mean loss
            rounded = trainer.train_round(record_ops=True)
            result, tokens = replace(rounded.steps[-1], loss=rounded.loss), rounded.tokens
        else:  # first/last stages read their pipeline's rows, middle stages no tokens (zeros of the same shape)
            batch = stage_tokens(source, step, engine.pipeline_slice(train.global_batch), engine.first or engine.last)
            result = engine.train_step(batch, record_ops=True)
        step_time = time.perf_counter() - t0
        payload = (result.timings, rank_memory_bytes(device.type), result.ops,
                   max(0, peak_since_reset(device.type) - held_before))
        gathered: list | None = [None] * world if rank == 0 else None
        dist.gather_object(payload, gathered, dst=0)
        flag.fill_(1.0 if stop.requested else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if log is not None and gathered is not None:
            log.record(step + stride, result.loss, tokens, step_time, result.lr, result.grad_norm,
                       max(int(g[1]) for g in gathered),
                       stage_times(ranks, [g[0] for g in gathered], [int(g[1]) for g in gathered],
                                   [int(g[3]) for g in gathered]),
                       memory_growth_bytes=max(int(g[3]) for g in gathered),
                       loss_scale=result.loss_scale, skipped=result.skipped)
            timeline = stage_ops(ranks, [g[2] for g in gathered], step + stride)
        done = step + stride
        stopping = flag.item() > 0
        due = done == config.steps or (config.checkpoint_every > 0 and done % config.checkpoint_every == 0)
        if config.checkpoint_dir and (due or stopping):
            phases.enter("checkpoint")
            with ckpt.one_line_save_errors(config.checkpoint_dir), timeouts.long():  # all wait while some write
                path = ckpt.save(config.checkpoint_dir, done, holder.state_for_checkpoint(), shards, manifest)
            found = path
            if rank == 0:
                say(f"flashflex: checkpoint {path}")
        if stopping:
            if rank == 0:
                say(f"flashflex: {stop.signal_name}: stopped after step {done}")
            break
        if step == start:
            timeouts.settle()  # the first step is done: survivors of a lost peer now wait --timeout at most
    if trainer is not None:
        trainer.flush()  # the last round's overlapped exchange, before the process group goes
    if log is not None:
        if timeline:
            write_timeline(config.out, timeline)
        log.close()
        if not heartbeat.under_local_launcher():  # the local launcher prints the same summary on its stdout
            for line in run_summary(log.rows, config.steps, time.monotonic() - started,
                                    predicted_step_seconds(plan.predicted), engine.compile_seconds,
                                    None if found is None else str(found), log.path):
                say(f"flashflex: {line}")
    engine.wait_for_parameters()  # no gather left in flight when the process group goes
    dist.barrier()
    heartbeat.mark_done()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one rank; print one line naming the rank on failure (an out-of-memory: runtime/device/oom.py's line)."""
    heartbeat.start()
    exit_quietly_on_stop_signals()
    args = parse_args(argv)
    phases = oom.PhaseTracker()
    try:
        from ...run_config import load_run_config

        return run(load_run_config(args.config), args.node, phases)
    except Exception as exc:  # report one line with the rank, then exit non-zero
        from ...errors import FlashflexError

        line = oom.report(exc, phases)
        if line is not None:
            say(f"flashflex worker: {line}")
            heartbeat.report_error(line)
            if os.environ.get("FLASHFLEX_DEBUG"):
                raise
            return 1
        label = os.environ.get("FLASHFLEX_RANK_LABEL", f"local rank {os.environ.get('LOCAL_RANK', '?')}")
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        peer = isinstance(exc, RuntimeError | TimeoutError) and not isinstance(exc, FlashflexError) and any(
            word in str(exc) for word in ("Connection", "closed", "reset", "Timed out", "timeout", "peer",
                                          "NCCL", "Gloo", "gloo", "recv", "send"))
        kind = "lost a peer" if peer else "failed"
        say(f"flashflex worker {label} {kind}: {type(exc).__name__}: {text}")
        heartbeat.report_error(text if isinstance(exc, FlashflexError) else f"{type(exc).__name__}: {text}")
        if os.environ.get("FLASHFLEX_DEBUG"):
            raise
        if isinstance(exc, FlashflexError):
            return exc.exit_code
        return PEER_LOST if peer else 1


def exit_now(code: int) -> NoReturn:
    """End the process with `code` at once: flush the output, then skip the interpreter's and C++ teardown.

    Everything a rank writes (checkpoints, metrics, its error line) is written and closed before `main` returns;
    what is left is teardown, where gloo's destructors may abort ("terminate called without an active
    exception") or wait on a peer still inside a collective, after the heartbeat thread has already stopped."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())

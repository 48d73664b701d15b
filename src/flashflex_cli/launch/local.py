"""Launch every rank of a plan on this host and supervise them until they end.

One worker process per plan device (`python -u -m flashflex_cli.runtime.training.worker --config RUN/config.json`: the run
configuration, run_config.py, is written before the first worker starts), in the launcher's process group, with
the environment torchrun would give (LOCAL_RANK, RANK, WORLD_SIZE, and MASTER_ADDR / MASTER_PORT of a TCP store
this process serves). The launcher then polls every `poll_s` seconds:
- a rank that exits non-zero ends the job: the others exit on their own once their collectives break (no
  signal: one arriving while a process shuts down can abort it and blur the report), else get SIGKILL after
  FAILURE_GRACE_S; one line names the rank that started it (failures.py), with its own error if it left one;
- a rank whose heartbeat (semantics/worker_protocol.py, runtime/training/heartbeat.py) is older than --timeout (at least 5 s) is frozen: it is
  killed and named;
- SIGTERM, SIGINT or SIGHUP (to the launcher alone, or to every process at once: scancel, systemd, Ctrl-C)
  is passed on once; the workers stop at their next step boundary and save a checkpoint; the launcher
  waits up to STOP_GRACE_S + --timeout before SIGKILL, and a second signal kills at once. The last line says
  whether a checkpoint was written, looked up in the checkpoint folder;
- when the launcher dies, even by SIGKILL, the workers die with it (parent-death signal, runtime/training/heartbeat.py).
`RUN/workers.json` names each rank's pid, plan rank and device while the job runs (for operators and tests).
`run_job` is the same supervision without the final report, for the elastic loop (launch/elastic.py): a poll
hook may ask every worker to stop at the next step boundary with a checkpoint (`LocalJob.request_stop`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..errors import RuntimeFailure
from ..fileio import atomic_write_text
from ..plan.schema import Plan
from ..run_config import RunConfig, save_run_config
from ..semantics import flight_recorder, worker_protocol
from .failures import (
    CheckpointStamp,
    Interrupted,
    checkpoint_note,
    checkpoint_stamp,
    describe_local_failure,
    stop_text,
)
from .gpu_subset import gpus_env
from .options import ALLOC_CONF_DEFAULT, ALLOC_CONF_ENV, ALLOC_CONF_SHELL, WORKER_MODULE, worker_argv
from .share_gpu import share_gpu_env

FAILURE_GRACE_S = 3.0  # after a rank failed: time for the others to see their collectives break and exit
STOP_GRACE_S = 30.0  # after a stop signal (plus --timeout): time to finish the step and save a checkpoint
PAUSE_S = 2.0  # a gap this long between two polls: the launcher itself was stopped (Ctrl-Z) or starved
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
WORKERS_FILE = "workers.json"  # in the run folder: pid, plan rank and device of every running worker


def local_command(plan: Plan, options: RunConfig) -> list[str]:
    """The equivalent single-host torchrun command line (what `--dry-run` prints; it names RUN/config.json, which
    a dry run does not write)."""
    return ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={plan.world_size}", "--max-restarts=0",
            "-m", WORKER_MODULE, *worker_argv(options.path)]


def dry_run_text(plan: Plan, options: RunConfig) -> str:
    """Shell text of the single-host command, with the allocator setting (and --gpus' CUDA_VISIBLE_DEVICES) the
    launcher gives its workers."""
    visible = "".join(f" {k}={shlex.quote(v)}" for k, v in gpus_env(options.gpu_indices).items())
    return f"env {ALLOC_CONF_SHELL}{visible} {shlex.join(local_command(plan, options))}"


@dataclass
class RankExit:
    """How one rank ended, in the fields failures.py reads."""

    local_rank: int
    exitcode: int
    timestamp: float
    reason: str | None = None
    silent: bool = False
    stopped: bool = False


@dataclass
class Worker:
    """One running rank: its process, since when (time.time()) its heartbeat counts, what the launcher did."""

    local_rank: int
    proc: subprocess.Popen[bytes]
    since: float
    killed: bool = False
    silent: str | None = None
    lingered: bool = False  # finished its training, then did not exit in time: killed, its work is complete


class StopSignals:
    """While entered: SIGTERM, SIGINT and SIGHUP are recorded in `received` instead of ending the launcher."""

    def __init__(self) -> None:
        self.received: list[signal.Signals] = []
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _record(self, signum: int, _frame: object) -> None:
        self.received.append(signal.Signals(signum))


def worker_env(local_rank: int, world: int, port: int, job_dir: str, timeout_s: float,
               run_dir: str | None = None, share_gpu: bool = False,
               gpus: tuple[int, ...] | None = None) -> dict[str, str]:
    """The environment of local rank `local_rank`: torchrun's variables and the launcher's (heartbeat.py), the
    CUDA caching allocator's expandable segments unless the user set PYTORCH_CUDA_ALLOC_CONF, NCCL's flight
    recorder with its dumps in `run_dir`/nccl-trace/ unless the user set them (semantics/flight_recorder.py), and
    with `share_gpu` the rank's own NCCL host (launch/share_gpu.py), with `gpus` only those GPUs visible
    (launch/gpu_subset.py)."""
    rank, size = str(local_rank), str(world)
    recorder = flight_recorder.worker_env(run_dir, os.environ) if run_dir else flight_recorder.fixed_env(os.environ)
    shared = {**(share_gpu_env(local_rank, os.environ) if share_gpu else {}), **gpus_env(gpus)}
    return {ALLOC_CONF_ENV: ALLOC_CONF_DEFAULT, **recorder, **os.environ, **shared, "LOCAL_RANK": rank, "RANK": rank, "ROLE_RANK": rank, "GROUP_RANK": "0",
            "LOCAL_WORLD_SIZE": size, "WORLD_SIZE": size, "ROLE_WORLD_SIZE": size, "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            worker_protocol.JOB_DIR_ENV: job_dir, worker_protocol.LAUNCHER_PID_ENV: str(os.getpid()),
            worker_protocol.INTERVAL_ENV: f"{worker_protocol.heartbeat_interval(timeout_s):g}"}


class LocalJob:
    """The workers of one local launch and the launcher's decisions about them."""

    def __init__(self, options: RunConfig, job_dir: str) -> None:
        self.options = options
        self.job_dir = job_dir
        self.workers: list[Worker] = []
        self.exits: dict[int, RankExit] = {}
        self.failing = False
        self.deadline: float | None = None
        self.stop_requested = False  # the launcher itself asked every rank to stop at a step boundary

    def spawn(self, world: int, port: int, signals: StopSignals, inherit_fds: tuple[int, ...]) -> None:
        """Start local ranks 0..world-1 (fewer when a stop signal arrives meanwhile)."""
        argv = [sys.executable, "-u", "-m", WORKER_MODULE, *worker_argv(self.options.path)]
        for local_rank in range(world):
            if signals.received:
                return
            env = worker_env(local_rank, world, port, self.job_dir, self.options.timeout_s, self.options.out,
                             self.options.share_gpu, self.options.gpu_indices)
            try:
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, pass_fds=inherit_fds)
            except OSError as exc:
                raise RuntimeFailure(f"cannot start local rank {local_rank}: {exc.strerror or exc}") from None
            self.workers.append(Worker(local_rank, proc, time.time()))

    def running(self) -> list[Worker]:
        """Workers not yet reaped."""
        return [w for w in self.workers if w.local_rank not in self.exits]

    def reap(self) -> None:
        """Record the workers that exited since the last call."""
        for worker in self.running():
            code = worker.proc.poll()
            if code is not None and worker.lingered:
                worker_protocol.say(f"flashflex: rank {worker.local_rank} finished training but did not exit in time; killed")
                code = 0
            if code is not None:
                self.exits[worker.local_rank] = RankExit(
                    worker.local_rank, code, time.monotonic(),
                    reason=worker.silent or worker_protocol.read_error(self.job_dir, worker.local_rank),
                    silent=worker.silent is not None, stopped=worker.killed and worker.silent is None)

    def failures(self) -> dict[int, RankExit]:
        """The ranks that ended non-zero (or were found frozen). After `request_stop`, a rank that left quietly
        on that SIGTERM before training began (exit 128 + 15) did not fail."""
        quiet = 128 + int(signal.SIGTERM) if self.stop_requested else None
        return {rank: e for rank, e in self.exits.items()
                if (e.exitcode != 0 and e.exitcode != quiet) or e.silent}

    def request_stop(self) -> None:
        """Ask every running rank to stop after its current step with a checkpoint (SIGTERM: the workers agree
        on the step through an all-reduce, save, and exit 0); SIGKILL after STOP_GRACE_S + --timeout."""
        if self.stop_requested or self.failing:
            return
        self.stop_requested = True
        self.signal_running(signal.SIGTERM, STOP_GRACE_S + self.options.timeout_s)

    def write_workers(self, plan: Plan) -> None:
        """Record pid, plan rank and device of every worker in RUN/workers.json (atomically)."""
        ranks = plan.ranks()
        rows = [{"local_rank": w.local_rank, "rank": ranks[w.local_rank].rank,
                 "device": ranks[w.local_rank].device, "pid": w.proc.pid} for w in self.workers]
        try:
            atomic_write_text(os.path.join(self.options.out, WORKERS_FILE),
                              json.dumps({"launcher_pid": os.getpid(), "plan": self.options.plan,
                                          "workers": rows}, indent=2) + "\n")
        except OSError:
            pass  # a record for humans: never a reason to stop the job

    def signal_running(self, sig: signal.Signals, grace_s: float) -> None:
        """Send `sig` to every running worker; SIGKILL the ones still running `grace_s` seconds from now."""
        for worker in self.running():
            self._send(worker, sig)
        self.kill_after(grace_s)

    def kill_after(self, grace_s: float) -> None:
        """SIGKILL the workers still running `grace_s` seconds from now (or at an earlier deadline)."""
        deadline = time.monotonic() + grace_s
        self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)

    def kill_running(self) -> None:
        """SIGKILL every running worker."""
        for worker in self.running():
            worker.killed = True
            self._send(worker, signal.SIGKILL)

    def check_health(self) -> None:
        """End the job when a rank failed or froze. A rank counts as frozen when its heartbeat is older than the
        silence limit, or, once another rank failed, older than three heartbeats and 5 s (it froze first)."""
        if self.failing:
            return
        timeout = self.options.timeout_s
        quiet = max(3 * worker_protocol.heartbeat_interval(timeout) + 1.0, worker_protocol.MIN_SILENCE_S)
        limit = quiet if self.failures() else worker_protocol.silence_limit(timeout)
        for worker in self.running():
            done = worker_protocol.finished_at(self.job_dir, worker.local_rank)
            if done is not None:  # training over: its teardown beats no heartbeat, but must end
                if time.time() - done > worker_protocol.silence_limit(timeout) + FAILURE_GRACE_S and not worker.killed:
                    worker.lingered = worker.killed = True
                    self._send(worker, signal.SIGKILL)
                continue
            age = worker_protocol.heartbeat_age(self.job_dir, worker.local_rank, worker.since)
            if age > limit:
                worker.silent = f"no heartbeat for {age:.0f} s (--timeout {timeout:g}): the process is frozen or stopped"
                worker.killed = True
                self._send(worker, signal.SIGKILL)
        if self.failures() or any(w.silent for w in self.workers):
            self.failing = True
            self.kill_after(FAILURE_GRACE_S)

    def forgive_pause(self) -> None:
        """Count heartbeats from now: the launcher was not looking (stopped with the job by Ctrl-Z, or starved)."""
        for worker in self.running():
            worker.since = time.time()

    @staticmethod
    def _send(worker: Worker, sig: signal.Signals) -> None:
        try:
            worker.proc.send_signal(sig)
        except ProcessLookupError:
            pass


PollHook = Callable[[LocalJob], None]


def _watch(job: LocalJob, signals: StopSignals, poll_s: float, hook: PollHook | None = None) -> None:
    """Poll until every worker has exited, ending the job on a failure, a frozen rank or a stop signal;
    `hook(job)` runs once per poll while no signal arrived."""
    handled, last = 0, time.monotonic()
    while job.running():
        if hook is not None and not signals.received:
            hook(job)
        now = time.monotonic()
        if now - last > PAUSE_S:
            job.forgive_pause()
        last = now
        job.reap()
        if len(signals.received) > handled:
            handled = len(signals.received)
            if handled == 1:
                job.signal_running(signals.received[0], STOP_GRACE_S + job.options.timeout_s)
            else:
                job.kill_running()
        job.check_health()
        if job.deadline is not None and time.monotonic() >= job.deadline:
            job.kill_running()
        time.sleep(poll_s)


def _serve_store(timeout_s: float) -> Any:
    """The job's TCP store on a free local port (workers join the process group through it)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


@dataclass
class JobOutcome:
    """How a local job ended: the stop signals the launcher received, the failed ranks (by local rank = plan
    rank), and whether the launcher itself stopped it at a step boundary (`LocalJob.request_stop`)."""

    signals: list[signal.Signals] = field(default_factory=list)
    failures: dict[int, RankExit] = field(default_factory=dict)
    stopped: bool = False


def run_job(plan: Plan, options: RunConfig, poll_s: float = 0.1, inherit_fds: tuple[int, ...] = (),
            hook: PollHook | None = None) -> JobOutcome:
    """Save the run configuration (RUN/config.json), then run every rank of the plan on this host and supervise
    them until the last one ended (module docstring); returns how it ended, raising only when the configuration
    cannot be written or a worker cannot be started."""
    save_run_config(options)
    job_dir = tempfile.mkdtemp(prefix=f"flashflex-{uuid.uuid4().hex[:8]}-")
    job = LocalJob(options, job_dir)
    try:
        with StopSignals() as signals:
            store = _serve_store(options.setup_seconds)
            job.spawn(plan.world_size, store.port, signals, inherit_fds)
            job.write_workers(plan)
            _watch(job, signals, poll_s, hook)
    finally:
        job.kill_running()
        for worker in job.workers:
            worker.proc.wait()
        shutil.rmtree(job_dir, ignore_errors=True)
    return JobOutcome(list(signals.received), job.failures(), job.stop_requested)


def interrupted(outcome: JobOutcome, options: RunConfig, before: CheckpointStamp | None) -> Interrupted:
    """The one-line ending of a job stopped by a signal, saying whether a checkpoint was written."""
    sig = outcome.signals[0]
    return Interrupted(f"{stop_text(sig)}: {checkpoint_note(options.checkpoint_dir, before)}", 128 + int(sig))


def launch_local(plan: Plan, options: RunConfig, poll_s: float = 0.1, inherit_fds: tuple[int, ...] = ()) -> None:
    """Run the plan on this host; returns when every rank finished. Raises RuntimeFailure when one failed or
    froze, Interrupted (exit code 128 + signal) when a signal stopped the job.

    inherit_fds: open descriptors the workers keep (the run-folder locks, launch/lock.py).
    """
    before = checkpoint_stamp(options.checkpoint_dir)
    outcome = run_job(plan, options, poll_s, inherit_fds)
    if outcome.signals:
        raise interrupted(outcome, options, before)
    if outcome.failures:
        from ..hardware.cluster import load_cluster

        raise describe_local_failure(plan, load_cluster(options.cluster), outcome.failures, options.out)

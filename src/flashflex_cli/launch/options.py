"""The settings of one training run, as passed to every worker on its command line."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from .. import validate_numbers
from ..errors import InputError
from ..semantics.runtime_paths import OPTIMIZER_PATHS, RuntimeOptions

WORKER_MODULE = "flashflex_cli.runtime.worker"
# The workers' CUDA caching allocator grows its segments instead of caching fixed blocks (less fragmentation over
# steps whose activations differ in size); a value the user set is kept.
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF_DEFAULT = "expandable_segments:True"
# The same default in a rendered shell command: the user's value where it is set on the host that runs it.
ALLOC_CONF_SHELL = f'{ALLOC_CONF_ENV}="${{{ALLOC_CONF_ENV}:-{ALLOC_CONF_DEFAULT}}}"'


@dataclass(frozen=True)
class RunOptions:
    """Everything a worker needs besides its (node, LOCAL_RANK). Paths as the user gave them.

    timeout_s: collective and rendezvous timeout in seconds, so survivors of a dead rank exit instead
    of hanging. lr: peak learning rate of AdamW. schedule_steps: length of the learning-rate schedule
    (default: steps), so a run can stop early and resume onto the same trajectory.
    """

    plan: str
    cluster: str
    out: str
    data: str = "synthetic"
    steps: int = 10
    seed: int = 0
    lr: float = 1e-3
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    timeout_s: float = 60.0
    schedule_steps: int | None = None
    init_from: str | None = None  # a local Hugging Face checkpoint folder for the initial weights (hf/load.py)
    # runtime switches (runtime/options.py RuntimeOptions), turned off only to measure what each one buys;
    # compile None: on for CUDA devices, off on CPU; optimizer "auto": fused on CUDA, foreach on CPU
    lean_p2p: bool = True
    overlap_dp: bool = True
    hierarchical_dp: bool = True
    compile: bool | None = None
    chunked_loss: bool = True
    optimizer: str = "auto"

    def __post_init__(self) -> None:
        """Range-check the numbers (InputError naming the option): nothing starts with a bad one."""
        validate_numbers.steps(self.steps)
        if self.schedule_steps is not None:
            validate_numbers.steps(self.schedule_steps, "--schedule-steps")
        validate_numbers.seed(self.seed)
        validate_numbers.learning_rate(self.lr)
        validate_numbers.timeout_s(self.timeout_s)
        validate_numbers.int_in_range(self.checkpoint_every, "--checkpoint-every", 0, validate_numbers.MAX_STEPS)
        if self.optimizer not in OPTIMIZER_PATHS:
            raise InputError(f"--optimizer must be one of {', '.join(OPTIMIZER_PATHS)}, got {self.optimizer!r}")

    def runtime(self) -> RuntimeOptions:
        """The runtime paths these options ask for (before a worker resolves them for its device)."""
        return RuntimeOptions(lean_p2p=self.lean_p2p, overlap_dp=self.overlap_dp, hierarchical_dp=self.hierarchical_dp,
                              compile=self.compile, chunked_loss=self.chunked_loss,
                              optimizer=self.optimizer)  # type: ignore[arg-type]

    def worker_argv(self, node: str | None = None) -> list[str]:
        """Arguments after `-m flashflex_cli.runtime.worker`."""
        argv = ["--plan", self.plan, "--cluster", self.cluster, "--data", self.data, "--steps", str(self.steps),
                "--out", self.out, "--seed", str(self.seed), "--lr", repr(self.lr),
                "--timeout", f"{self.timeout_s:g}"]
        if self.schedule_steps:
            argv += ["--schedule-steps", str(self.schedule_steps)]
        if self.checkpoint_dir:
            argv += ["--checkpoint-dir", self.checkpoint_dir, "--checkpoint-every", str(self.checkpoint_every)]
        if self.resume:
            argv.append("--resume")
        if self.init_from:
            argv += ["--init-from", self.init_from]
        argv += [flag for flag, on in (("--no-lean-p2p", self.lean_p2p), ("--no-overlap-dp", self.overlap_dp),
                                       ("--no-hierarchical-dp", self.hierarchical_dp),
                                       ("--no-chunked-loss", self.chunked_loss)) if not on]
        if self.compile is not None:
            argv.append("--compile" if self.compile else "--no-compile")
        if self.optimizer != "auto":
            argv += ["--optimizer", self.optimizer]
        if node is not None:
            argv += ["--plan-node", node]
        return argv

    def worker_shell(self, node: str | None = None) -> str:
        """The worker arguments as one shell-quoted string."""
        return shlex.join(self.worker_argv(node))

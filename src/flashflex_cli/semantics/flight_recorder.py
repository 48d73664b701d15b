"""NCCL's flight recorder for every worker, its dumps kept in the run folder.

On NCCL a collective that outlives its timeout is not a Python exception: ProcessGroupNCCL's watchdog thread
ends the process with SIGABRT. With the flight recorder on (a ring buffer of each rank's last collectives) the
watchdog first writes that buffer to a file per rank, which tells which collective every rank was waiting in
and so which peer never came. Settings, each kept where the user set it (either of its names):

- TORCH_NCCL_DUMP_ON_TIMEOUT=1: dump on a timeout;
- TORCH_NCCL_TRACE_BUFFER_SIZE (newer torch: TORCH_FR_BUFFER_SIZE) = TRACE_ENTRIES: the buffer's entries (0
  turns the recorder off, and with it the dump);
- TORCH_NCCL_DEBUG_INFO_TEMP_FILE (newer torch: TORCH_FR_DUMP_TEMP_FILE) = RUN/nccl-trace/rank-: the dump
  file's prefix; torch appends the rank.

Launchers put the first two in the workers' environment (launch/local.py, the rendered torchrun and SLURM
scripts); the worker adds what is still missing, the prefix included (it knows the run folder), and creates the
folder, before its process group exists. Gloo ignores all of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

TRACE_ENTRIES = 2000  # each rank's last collectives kept in the ring buffer (a hang is at the end of it)
TRACE_FOLDER = "nccl-trace"  # in the run folder
DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
BUFFER_SIZE = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
DUMP_FILE = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")
FIXED: tuple[tuple[tuple[str, ...], str], ...] = ((DUMP_ON_TIMEOUT, "1"), (BUFFER_SIZE, str(TRACE_ENTRIES)))


def trace_prefix(run_dir: str | os.PathLike[str]) -> str:
    """The dump files' prefix in run folder `run_dir` (torch appends the rank)."""
    return os.path.join(os.fspath(run_dir), TRACE_FOLDER, "rank-")


def _missing(names: tuple[str, ...], environ: Mapping[str, str]) -> bool:
    return not any(name in environ for name in names)


def fixed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The run-independent settings the user did not set in `environ` (every name of each)."""
    return {name: value for names, value in FIXED if _missing(names, environ) for name in names}


def worker_env(run_dir: str | os.PathLike[str], environ: Mapping[str, str]) -> dict[str, str]:
    """Every setting the user did not set in `environ`, the dump prefix in `run_dir` included."""
    out = fixed_env(environ)
    if _missing(DUMP_FILE, environ):
        out.update(dict.fromkeys(DUMP_FILE, trace_prefix(run_dir)))
    return out


def prefix_in_effect(run_dir: str | os.PathLike[str], environ: Mapping[str, str]) -> str:
    """The dump files' prefix the workers use: the user's where set (either name), else the run folder's."""
    return next((environ[name] for name in DUMP_FILE if name in environ), trace_prefix(run_dir))


def prepare(run_dir: str | os.PathLike[str], environ: MutableMapping[str, str] | None = None) -> str:
    """Complete the settings in `environ` (default: this process's) and create the dump folder; returns the
    dump prefix in effect. Call before the NCCL process group is created."""
    env = os.environ if environ is None else environ
    env.update(worker_env(run_dir, env))
    prefix = prefix_in_effect(run_dir, env)
    folder = os.path.dirname(prefix)
    if folder:
        os.makedirs(folder, exist_ok=True)
    return prefix

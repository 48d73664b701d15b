"""Running the benchmarks' commands: one at a time, or one per namespace host all at once, and the wall time,
CPU time and load average they take (the machine is shared: figures are printed beside them).

Imported as `benchmarks.commands` by scripts that put the repository root on sys.path."""

from __future__ import annotations

import os
import resource
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class CommandFailed(Exception):
    """A command failed or ran out of time; the message holds its output's tail."""


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for descendants so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a command to its end; CommandFailed with its output's tail when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise CommandFailed(f"failed ({done.returncode}): {shlex.join(command)}\n{done.stdout[-2000:]}"
                            f"{done.stderr[-4000:]}")
    return done


def run_all(commands: list[tuple[list[str], dict[str, str] | None]], timeout_s: float,
            label: str = "a host") -> None:
    """Start every (command, environment) at once (one per namespace host; None: this environment), wait for
    all; kill every one and raise CommandFailed if one fails or the time runs out."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd, env in commands]
    deadline = time.monotonic() + timeout_s
    failed: str | None = None
    try:
        for proc in procs:
            try:
                output = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
            except subprocess.TimeoutExpired:
                raise CommandFailed(f"{label} did not finish within {timeout_s:g} s") from None
            if proc.returncode != 0:
                failed = f"{label} failed ({proc.returncode}):\n{output[-4000:]}"
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if failed:
        raise CommandFailed(failed)


@contextmanager
def usage() -> Iterator[dict[str, float]]:
    """Yields a dict that holds, once the block ends, its wall and children's CPU seconds and the 1-minute load
    average before and after (`wall_s`, `cpu_s`, `load_before`, `load_after`)."""
    figures: dict[str, float] = {}
    load, cpu, start = os.getloadavg()[0], children_cpu_s(), time.perf_counter()
    yield figures
    figures.update(wall_s=time.perf_counter() - start, cpu_s=children_cpu_s() - cpu, load_before=load,
                   load_after=os.getloadavg()[0])

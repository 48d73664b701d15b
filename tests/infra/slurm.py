"""A real SLURM on this machine for tests: two virtual nodes (n1, n2) on one host.

Recipe: /work/shared/recipes/slurm-local.md (Debian's slurm-wlm 22.05 + munge). `slurm_available()` installs
the packages with apt-get when missing and running as root, or says why it cannot. `LocalSlurm` writes a
private slurm.conf under a temporary folder, starts munged (if not running), slurmctld and two slurmd, and
stops its slurmctld and slurmd (by the PIDs in their pid files) on exit; munged, which another test run beside
this one may share, stays running.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from flashflex_cli.hardware.probe_gloo import free_port

PACKAGES = ("slurm-wlm", "munge")
_CONF = """ClusterName=ffxtest
SlurmctldHost={host}
SlurmUser=slurm
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
MailProg=/bin/true
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldPort={port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={port1} CPUs={cpus} State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={port2} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


def _run(cmd: list[str], timeout: float = 60, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def slurm_available(install: bool = True) -> tuple[bool, str]:
    """(True, "") when slurmctld, slurmd, sbatch and munged exist, installing them with apt-get if allowed."""
    tools = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
    if all(shutil.which(t) or Path(f"/usr/sbin/{t}").exists() for t in tools):
        return True, ""
    if os.geteuid() != 0:
        return False, "SLURM is not installed and installing it needs root"
    if not install or shutil.which("apt-get") is None:
        return False, "SLURM is not installed and apt-get is unavailable"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    update = _run(["apt-get", "update"], timeout=120, env=env)
    if update.returncode != 0:
        return False, f"apt-get update failed: {update.stderr.strip()[-200:]}"
    got = _run(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES], timeout=300, env=env)
    if got.returncode != 0:
        return False, f"apt-get install {' '.join(PACKAGES)} failed: {got.stderr.strip()[-200:]}"
    return True, ""


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class LocalSlurm:
    """Context manager: a running two-node SLURM; `env` holds SLURM_CONF for sbatch/scontrol/srun."""

    def __init__(self, cpus: int = 2) -> None:
        self.cpus = cpus
        self.root = Path(tempfile.mkdtemp(prefix="ffx-slurm-"))
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _sbin(self, name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def start(self) -> None:
        """Start munged (when not running), slurmctld and slurmd n1, n2; wait until both nodes are idle."""
        # munged is the host's shared authentication daemon: started when absent and left running, because
        # another test run beside this one may be using it (stopping it would break that run's jobs).
        if _run(["pgrep", "-x", "munged"]).returncode != 0:
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            os.chmod("/run/munge", 0o755)
            started = _run(["runuser", "-u", "munge", "--", self._sbin("munged")])
            if started.returncode != 0 and _run(["pgrep", "-x", "munged"]).returncode != 0:
                raise RuntimeError(f"munged did not start: {started.stderr.strip()}")
        host = socket.gethostname()
        self.conf.write_text(_CONF.format(host=host, root=self.root, port=free_port(), port1=free_port(),
                                          port2=free_port(), cpus=self.cpus))
        (self.root / "state").mkdir()
        shutil.chown(self.root / "state", "slurm", "slurm")
        os.chmod(self.root, 0o755)
        for cmd in ([self._sbin("slurmctld"), "-f", str(self.conf), "-c"],
                    [self._sbin("slurmd"), "-f", str(self.conf), "-N", "n1"],
                    [self._sbin("slurmd"), "-f", str(self.conf), "-N", "n2"]):
            result = _run(cmd, env=self.env)
            if result.returncode != 0:
                raise RuntimeError(f"{Path(cmd[0]).name} did not start: {result.stderr.strip()} {self.logs()}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = _run(["sinfo", "-h", "-o", "%T %D"], env=self.env).stdout.split()
            if info[:2] == ["idle", "2"]:
                return
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes did not become idle: {info} {self.logs()}")

    def submit(self, script: Path, cwd: Path) -> str:
        """sbatch `script` from `cwd`; returns the job id."""
        result = _run(["sbatch", "--parsable", str(script)], env=self.env, cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def wait(self, job_id: str, timeout_s: float) -> list[str]:
        """Poll `scontrol show job` until every component has ended; returns their JobStates."""
        deadline = time.monotonic() + timeout_s
        states: list[str] = []
        while time.monotonic() < deadline:
            text = _run(["scontrol", "show", "job", job_id], env=self.env).stdout
            states = re.findall(r"JobState=(\w+)", text)
            if states and all(s not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") for s in states):
                return states
            time.sleep(0.5)
        _run(["scancel", job_id], env=self.env)
        raise TimeoutError(f"job {job_id} still {states} after {timeout_s:.0f} s")

    def logs(self) -> str:
        """The tail of the daemons' logs, for failure messages."""
        parts = []
        for log in sorted(self.root.glob("*.log")):
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop this instance's slurmctld and slurmd (by their pid files; munged stays) and remove its folder."""
        pid_files = [self.root / "slurmd-n1.pid", self.root / "slurmd-n2.pid", self.root / "slurmctld.pid"]
        for pid_file in pid_files:
            pid = _read_pid(pid_file)
            if pid is not None:
                try:
                    os.kill(pid, 15)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalSlurm:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

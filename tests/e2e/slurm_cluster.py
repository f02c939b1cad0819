"""A real one-host Slurm cluster for tests: munged, slurmctld and slurmd started from a temp dir.

Everything lives under the given directory (config, munge key and socket, state and spool dirs, logs);
nothing in /etc is read or written. The daemons run as root (SlurmUser=root) in the foreground and are
stopped by pid. ``cluster_or_skip`` says why when it cannot run (no binaries, not root).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from stalwart.utils.ports import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue")


def missing() -> str | None:
    """Why a Slurm cluster cannot run here, or None."""
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if absent:
        return f"Slurm not installed ({', '.join(absent)} missing; `apt-get install -y slurm-wlm munge`, see .ci/run)"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root (SlurmUser=root)"
    return None


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


CONF = """\
ClusterName=stalwart
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge/munge.socket,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
SlurmdDebug=info
SlurmctldDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
PlugStackConfig={dir}/plugstack.conf
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    dir: Path
    cpus: int = 4
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}

    def start(self) -> SlurmCluster:
        d = self.dir
        for sub in ("munge", "ctld", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "munge").chmod(0o700)
        (d / "plugstack.conf").write_text("")
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        conf = CONF.format(host=self.host, ctld_port=free_port(), d_port=free_port(), dir=d, cpus=self.cpus)
        (d / "slurm.conf").write_text(conf)
        m = d / "munge"
        self._spawn(
            [
                _which("munged"),
                "--foreground",
                "--force",
                f"--key-file={key}",
                f"--socket={m}/munge.socket",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
            "munged",
        )
        self._wait(lambda: (m / "munge.socket").exists(), "munged's socket")
        self._spawn([_which("slurmctld"), "-D", "-i", "-f", str(d / "slurm.conf")], "slurmctld")
        self._spawn([_which("slurmd"), "-D", "-N", self.host, "-f", str(d / "slurm.conf")], "slurmd")
        self._wait(self._node_idle, "the node to become idle", timeout_s=60)
        return self

    def _spawn(self, cmd: list[str], name: str) -> None:
        out = open(self.dir / f"{name}.out", "wb")
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env))
        out.close()

    def _wait(self, ready, what: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited ({p.returncode}) while waiting for {what}: {self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}: {self.logs()}")
            time.sleep(0.2)

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
        return out.startswith("idle")

    def logs(self) -> str:
        tails = []
        for name in ("slurmctld.log", "slurmd.log", "munge/munged.log"):
            p = self.dir / name
            if p.exists():
                tails.append(f"--- {name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(tails)

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 30, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [_which(cmd[0]), *cmd[1:]], capture_output=True, text=True, env={**self.env, **(env or {})}, timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        text = self.run("scontrol", "show", "job", job_id, "-o").stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def stop(self) -> None:
        """Cancel what still runs (a failed test), then stop the daemons, slurmd first."""
        if self.procs and self.procs[-1].poll() is None:
            self.run("scancel", "--user", "root", check=False)
            deadline = time.monotonic() + 30
            while self.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

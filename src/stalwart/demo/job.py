"""The demo job: two agents ("nodes") of one worker each on this host, the debug model, injected faults.

It runs what a real multi-node job runs — a job master, two `stalwart run` agents meeting in a c10d
rendezvous, `stalwart train` workers with flash (memory-only) checkpoints every step — and injects a
SIGKILL, an exception and a hang on rank 1 at distinct steps (chaos specs, each firing once). The
console shows incidents as the master journals them; ``stalwart.demo.report`` measures the recovery.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from stalwart.checkpoint.shm import default_shm_root, user_dir
from stalwart.launch.master import Master, new_token
from stalwart.runtime import ENV_CHAOS, ENV_CHAOS_DIR, ENV_JOB_TOKEN
from stalwart.utils.ports import free_port

FAULTS = ("kill", "exception", "hang")  # injected on rank 1, at 1/4, 1/2 and 3/4 of the steps
NODES = 2


@dataclass
class DemoOptions:
    steps: int = 300
    out_dir: Path = Path("runs/demo")
    faults: tuple[str, ...] = FAULTS
    fault_rank: int = 1
    hang_timeout_s: float = 10.0
    reference: bool = True  # compare against a fault-free run (cached)
    job_timeout_s: float = 900.0
    shm_root: str = ""  # the trainer's checkpoint.shm_dir default ("" = $STALWART_SHM_DIR or /dev/shm)

    def fault_steps(self) -> list[tuple[str, int]]:
        n = len(self.faults)
        return [(action, max(1, self.steps * (i + 1) // (n + 1))) for i, action in enumerate(self.faults)]

    def train_overrides(self) -> dict[str, str]:
        """The training config of both the demo and its reference (what the cache is keyed by)."""
        # 64-token sequences and one thread per worker keep 2 workers + the reference run within a few
        # minutes on 2 cores.
        return {
            "train.steps": str(self.steps),
            "data.seq_len": "64",
            "train.threads": "1",
            "train.log_every": "50",
            "checkpoint.enabled": "true",
            "checkpoint.persist_every_steps": "0",
            "checkpoint.persist_every_s": "0",
        }


@dataclass
class JobResult:
    exit_codes: list[int]
    wall_s: float
    incidents: list[dict[str, Any]]
    restarts_used: int
    summary: dict[str, Any] | None  # the trainer's summary.json (rank 0)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.exit_codes) and self.summary is not None


class Live:
    """Prints journaled incidents and progress as they happen (rich on a terminal, plain otherwise)."""

    def __init__(self, console: Console, steps: int) -> None:
        self.console, self.steps = console, steps
        self._shown: dict[int, set[str]] = {}
        self._last_step, self._last_print = -1, 0.0
        self.t0 = time.time()

    def poll(self, master: Master) -> None:
        now = time.time()
        for inc in master.journal.incidents():
            seen = self._shown.setdefault(inc["id"], set())
            where = f"{inc['node_id']}" + (f" rank {inc['details']['rank']}" if "rank" in inc["details"] else "")
            if "detected" not in seen and inc["detected"]:
                seen.add("detected")
                lag = f" {inc['detected'] - inc['fault']:.1f} s after the fault" if inc["fault"] else ""
                note = " (a consequence: its peer failed)" if inc["details"].get("consequential") else ""
                self.console.print(
                    f"[{now - self.t0:6.1f}s] [bold red]incident[/] {inc['kind']} ({inc['class']}) "
                    f"on {where}: detected{lag}{note}"
                )
            if "first_step" not in seen and inc["first_step"]:
                seen.add("first_step")
                since = inc["fault"] or inc["detected"]
                self.console.print(
                    f"[{now - self.t0:6.1f}s] [bold green]recovered[/] from {inc['kind']}: training "
                    f"again {inc['first_step'] - since:.1f} s after the fault"
                )
        steps = [r["step"] for n in master.journal.nodes() for r in n["progress"].get("ranks", [])]
        step = min(steps) if steps else -1
        if step > 0 and step != self._last_step and now - self._last_print >= 5.0:
            self._last_step, self._last_print = step, now
            self.console.print(f"[{now - self.t0:6.1f}s] step {step}/{self.steps}")


def run_job(opts: DemoOptions, job_dir: Path, chaos: str | None, console: Console) -> JobResult:
    """One job: an in-process master, NODES `stalwart run` agents, `stalwart train` workers."""
    if job_dir.exists():
        shutil.rmtree(job_dir)
    job_dir.mkdir(parents=True)
    token, job_id, port = new_token(), f"demo-{uuid.uuid4().hex[:8]}", free_port()
    master = Master(
        job_dir / "journal.sqlite", token, job_id=job_id, restart_budget=len(opts.faults) + 2, node_timeout_s=60.0
    ).start()
    train_args = [f"--{k}={v}" for k, v in opts.train_overrides().items()]
    train_args += [f"--train.out_dir={job_dir / 'train'}", f"--checkpoint.dir={job_dir / 'ckpt'}"]
    # the token travels in the environment, not on the command line (other users can read `ps`)
    env = {**os.environ, ENV_CHAOS_DIR: str(job_dir / "chaos-fired"), ENV_JOB_TOKEN: token, "PYTHONUNBUFFERED": "1"}
    env.pop(ENV_CHAOS, None)
    procs, logs = [], []
    start = time.time()
    try:
        for n in range(NODES):
            cmd = [
                sys.executable,
                "-m",
                "stalwart",
                "run",
                "--nnodes",
                str(NODES),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                job_id,
                "--master",
                master.address,
                "--node-id",
                f"node{n}",
                "--max-restarts",
                str(len(opts.faults) + 2),
                "--hang-timeout",
                str(opts.hang_timeout_s),
                "--run-dir",
                str(job_dir / f"node{n}"),
                "--summary-json",
                str(job_dir / f"node{n}.json"),
                *(["--chaos", chaos] if chaos else []),
                "-m",
                "stalwart",
                "train",
                *train_args,
            ]
            logs.append(job_dir / f"node{n}.log")
            with open(logs[-1], "w") as log:
                procs.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                )
        live = Live(console, opts.steps)
        deadline = time.monotonic() + opts.job_timeout_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the demo job did not finish in {opts.job_timeout_s:.0f} s; logs: {', '.join(map(str, logs))}"
                )
            live.poll(master)
            time.sleep(0.5)
        live.poll(master)
        wall = time.time() - start
        summary_path = job_dir / "train" / "summary.json"
        metrics_path = job_dir / "train" / "metrics.jsonl"
        return JobResult(
            [p.returncode for p in procs],
            wall,
            master.journal.incidents(),
            int(master.journal.get("restarts_used", 0)),
            json.loads(summary_path.read_text()) if summary_path.exists() else None,
            [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else [],
            logs,
        )
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        master.stop()
        for shm in user_dir(opts.shm_root or default_shm_root()).glob(f"{job_id}*"):  # left behind by a failed job
            shutil.rmtree(shm, ignore_errors=True)

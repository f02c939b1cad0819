"""The demo job: two agents ("nodes") of one worker each on this host, the debug model, injected faults.

It runs what a real multi-node job runs — a job master, two `stalwart run` agents meeting in a c10d
rendezvous, `stalwart train` workers with flash (memory-only) checkpoints every step — and injects a
SIGKILL, an exception and a hang on rank 1 at distinct steps (chaos specs, each firing once). The
console shows incidents as the master journals them; the report measures the recovery:

  detected_s   fault → the agent noticed (signal / exit: ~immediately; hang: the --hang-timeout)
  mttr_s       fault → the first step completed by every rank after the restart
  lost_steps   steps completed before the fault that had to be recomputed (last step logged before
               the detection − the step the restart resumed from)
  goodput      productive step time ÷ wall time: the step times of the steps that survived (the last
               record of each step in metrics.jsonl) summed, over the wall time from starting the
               agents to their exit (start-up, restarts, recomputation and checkpoint stalls are lost)
  stall_s      checkpoint time the training loop blocked on (pre-step hook waits + save calls) in the
               final attempt of rank 0 (the trainer reports per attempt)
  bitwise_equal  the final weights' hash equals that of a fault-free run with the same config and
               world size (computed once and cached in OUT_DIR/reference.json, keyed by the config)
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from stalwart.launch.master import Master

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
    shm_root: str = "/dev/shm"  # the trainer's checkpoint.shm_dir default

    def fault_steps(self) -> list[tuple[str, int]]:
        n = len(self.faults)
        return [(action, max(1, self.steps * (i + 1) // (n + 1))) for i, action in enumerate(self.faults)]

    def train_overrides(self) -> dict[str, str]:
        """The training config of both the demo and its reference (what the cache is keyed by)."""
        # 64-token sequences and one thread per worker keep 2 workers + the reference run within a few
        # minutes on 2 cores.
        return {"train.steps": str(self.steps), "data.seq_len": "64", "train.threads": "1", "train.log_every": "50",
                "checkpoint.enabled": "true", "checkpoint.persist_every_steps": "0",
                "checkpoint.persist_every_s": "0"}


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                self.console.print(f"[{now - self.t0:6.1f}s] [bold red]incident[/] {inc['kind']} ({inc['class']}) "
                                   f"on {where}: detected{lag}{note}")
            if "first_step" not in seen and inc["first_step"]:
                seen.add("first_step")
                since = inc["fault"] or inc["detected"]
                self.console.print(f"[{now - self.t0:6.1f}s] [bold green]recovered[/] from {inc['kind']}: training "
                                   f"again {inc['first_step'] - since:.1f} s after the fault")
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
    token, job_id, port = secrets.token_urlsafe(24), f"demo-{uuid.uuid4().hex[:8]}", _free_port()
    master = Master(job_dir / "journal.sqlite", token, job_id=job_id,
                    restart_budget=len(opts.faults) + 2, node_timeout_s=60.0).start()
    train_args = [f"--{k}={v}" for k, v in opts.train_overrides().items()]
    train_args += [f"--train.out_dir={job_dir / 'train'}", f"--checkpoint.dir={job_dir / 'ckpt'}"]
    env = {**os.environ, "STALWART_CHAOS_DIR": str(job_dir / "chaos-fired"), "PYTHONUNBUFFERED": "1"}
    env.pop("STALWART_CHAOS", None)
    procs, logs = [], []
    start = time.time()
    try:
        for n in range(NODES):
            cmd = [sys.executable, "-m", "stalwart", "run", "--nnodes", str(NODES), "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job_id,
                   "--master", master.address, "--job-token", token, "--node-id", f"node{n}",
                   "--max-restarts", str(len(opts.faults) + 2), "--hang-timeout", str(opts.hang_timeout_s),
                   "--run-dir", str(job_dir / f"node{n}"), "--summary-json", str(job_dir / f"node{n}.json"),
                   *(["--chaos", chaos] if chaos else []), "-m", "stalwart", "train", *train_args]
            logs.append(job_dir / f"node{n}.log")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        live = Live(console, opts.steps)
        deadline = time.monotonic() + opts.job_timeout_s
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the demo job did not finish in {opts.job_timeout_s:.0f} s; logs: "
                                   f"{', '.join(map(str, logs))}")
            live.poll(master)
            time.sleep(0.5)
        live.poll(master)
        wall = time.time() - start
        summary_path = job_dir / "train" / "summary.json"
        metrics_path = job_dir / "train" / "metrics.jsonl"
        return JobResult(
            [p.returncode for p in procs], wall, master.journal.incidents(),
            int(master.journal.get("restarts_used", 0)),
            json.loads(summary_path.read_text()) if summary_path.exists() else None,
            [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else [],
            logs)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        master.stop()
        for shm in Path(opts.shm_root, "stalwart").glob(f"{job_id}*"):  # left behind by a failed job
            shutil.rmtree(shm, ignore_errors=True)


def recoveries(incidents: list[dict[str, Any]], fault_rank: int | None = None) -> list[dict[str, Any]]:
    """One entry per fault. Every agent of a job reports the same fault (the peer of a killed rank
    sees a broken connection; a hang silences every rank), so incidents detected before the group's
    first step after restart belong together; the cause is the non-consequential one on the faulted
    rank, else the earliest; the fault time is the group's earliest."""
    groups: list[list[dict[str, Any]]] = []
    for inc in sorted((i for i in incidents if i["details"].get("source") != "worker"), key=lambda i: i["detected"]):
        recovered = min((i["first_step"] for i in groups[-1] if i["first_step"]), default=None) if groups else 0.0
        if groups and (recovered is None or inc["detected"] <= recovered):
            groups[-1].append(inc)
        else:
            groups.append([inc])
    out = []
    for group in groups:
        cause = min(group, key=lambda i: (bool(i["details"].get("consequential")),
                                          fault_rank not in i["details"].get("ranks", []), i["fault"] or i["detected"]))
        fault = min(i["fault"] or i["detected"] for i in group)
        first = min((i["first_step"] for i in group if i["first_step"]), default=None)
        out.append({"kind": cause["kind"], "class": cause["class"], "node_id": cause["node_id"], "fault": fault,
                    "detected": min(i["detected"] for i in group), "first_step": first,
                    "last_step": max(i["details"].get("last_step", -1) for i in group)})
    return out


def lost_steps(metrics: list[dict[str, Any]], detected: float, last_step: int) -> int | None:
    """Last step completed before the fault was detected (logged, or reported to the agents) − the step
    the restart resumed from: the first step logged after detection − 1 (the restart comes after the
    detection and surviving ranks are blocked in a collective until then)."""
    before = [m["step"] for m in metrics if m["time"] <= detected]
    after = [m["step"] for m in metrics if m["time"] > detected]
    if not after:
        return None
    return max(0, max(before, default=last_step) - (after[0] - 1), last_step - (after[0] - 1))


def report(job: JobResult, injected: list[tuple[str, int]], reference_hash: str | None,
           reference_cached: bool, fault_rank: int | None = None) -> dict[str, Any]:
    incidents, unmatched = [], list(injected)
    for rec in recoveries(job.incidents, fault_rank):
        # Which injected fault this was: the one at the last step reported before it (an incident
        # nobody injected — a real one — stays unattributed instead of shifting the others).
        match = next((f for f in unmatched if abs(f[1] - rec["last_step"]) <= 1), None)
        if match is not None:
            unmatched.remove(match)
        action, step = match or (None, None)
        incidents.append({
            "kind": rec["kind"], "class": rec["class"], "injected": action, "at_step": step, "node_id": rec["node_id"],
            "detected_s": round(rec["detected"] - rec["fault"], 3),
            "mttr_s": round(rec["first_step"] - rec["fault"], 3) if rec["first_step"] else None,
            "lost_steps": lost_steps(job.metrics, rec["detected"], rec["last_step"])})
    survived = {m["step"]: m["step_time_s"] for m in job.metrics}  # the later record of a step wins
    summary = job.summary or {}
    ckpt = summary.get("checkpoint") or {}
    final_hash = summary.get("final_hash")
    return {
        "steps": summary.get("steps"), "wall_s": round(job.wall_s, 3), "restarts_used": job.restarts_used,
        "incidents": incidents,
        "goodput": round(sum(survived.values()) / job.wall_s, 4) if job.wall_s else None,
        "stall_s": round(ckpt.get("hook_wait_s", 0.0) + ckpt.get("save_call_s", 0.0), 3),
        "final_hash": final_hash, "reference_hash": reference_hash, "reference_cached": reference_cached,
        "bitwise_equal": (final_hash == reference_hash) if reference_hash and final_hash else None,
    }


def _reference_key(opts: DemoOptions, data_dir: Path) -> str:
    import torch

    from stalwart import __version__

    manifest = (data_dir / "manifest.json").read_bytes() if (data_dir / "manifest.json").exists() else b""
    blob = json.dumps({"overrides": opts.train_overrides(), "nodes": NODES, "torch": torch.__version__,
                       "stalwart": __version__, "data": hashlib.sha256(manifest).hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reference_hash(opts: DemoOptions, data_dir: Path, console: Console) -> tuple[str, bool]:
    """(hash, cached): the final weights of a fault-free run of the same job, cached by config."""
    cache, key = opts.out_dir / "reference.json", _reference_key(opts, data_dir)
    cached = json.loads(cache.read_text()) if cache.exists() else {}
    if key in cached:
        return cached[key], True
    console.print(f"reference: fault-free run of the same job ({opts.steps} steps), cached in {cache}")
    job = run_job(opts, opts.out_dir / "reference", None, console)
    if not job.ok:
        raise RuntimeError(f"the reference run failed (exit codes {job.exit_codes}); logs: "
                           f"{', '.join(map(str, job.logs))}")
    cached[key] = job.summary["final_hash"]  # type: ignore[index]
    cache.write_text(json.dumps(cached, indent=1))
    return cached[key], False


def run_demo(opts: DemoOptions, console: Console) -> tuple[dict[str, Any], bool]:
    """Run the faulted job (and the reference unless cached); (report, job succeeded)."""
    from stalwart.config import load_config
    from stalwart.data import ensure_default_corpus

    if opts.steps < 4 * (len(opts.faults) + 1):
        raise ValueError(f"--steps must be ≥ {4 * (len(opts.faults) + 1)} to space {len(opts.faults)} faults apart")
    if opts.hang_timeout_s <= 0:
        raise ValueError("--hang-timeout must be > 0 seconds")
    cfg = load_config(None, opts.train_overrides())
    cfg.validate(NODES)
    data_dir = ensure_default_corpus(cfg.data.dir)  # once here, not racing in both workers
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    ref, cached = reference_hash(opts, data_dir, console) if opts.reference else (None, False)
    injected = opts.fault_steps()
    spec = ";".join(f"{action}:rank={opts.fault_rank}:step={step}" for action, step in injected)
    console.print(f"demo: {NODES} nodes × 1 worker, debug model, {opts.steps} steps; injecting "
                  + (", ".join(f"{a} at step {s}" for a, s in injected) or "no faults")
                  + f" on rank {opts.fault_rank}")
    job = run_job(opts, opts.out_dir / "job", spec or None, console)
    result = report(job, injected, ref, cached, opts.fault_rank)
    result["logs"] = [str(p) for p in job.logs]
    if not job.ok:
        console.print(f"[bold red]the demo job failed[/] (exit codes {job.exit_codes}); logs: "
                      f"{', '.join(map(str, job.logs))}")
    return result, job.ok

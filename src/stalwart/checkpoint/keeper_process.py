"""The keeper as a process: ``python -m stalwart.checkpoint JOB_DIR [--parent AGENT_PID]``. With
``--parent`` it serves the node's job directory while the agent lives (job after job) and, on SIGTERM or
when the agent is gone, finishes what is due within ``--grace-s`` (``StopRequest``); without, a worker
started it for one job. See docs/checkpoint.md, "Tier 2: persistence".
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart import runtime
from stalwart.checkpoint.shm import (
    FETCHED,
    REPLICA_STATUS,
    REPLICAS_DIR,
    JobPaths,
    ShmPermissionError,
    default_shm_root,
    read_json,
    user_dir,
)
from stalwart.checkpoint.shm_gc import KEPT, collect, kept_line, remove
from stalwart.checkpoint.storage_health import INCIDENTS_FILE

if TYPE_CHECKING:
    from stalwart.checkpoint.node_job import NodeJob

log = logging.getLogger("stalwart.checkpoint.keeper")
LOG_FORMAT = "%(asctime)s keeper[%(process)d] %(levelname)s %(message)s"


class StopRequest:
    """The agent's keeper is asked to stop by SIGTERM (the agent exits) or by the agent's death
    (PR_SET_PDEATHSIG, and a parent-pid check for other systems). From then on it has ``grace_s``
    seconds to finish; a watchdog ends the process after that, so it never outlives the agent for long."""

    def __init__(self, parent: int, grace_s: float) -> None:
        self.parent, self.grace_s = parent, grace_s
        self.why: str | None = None
        self.logged = False
        signal.signal(signal.SIGTERM, lambda *_: self.request("the agent stops the keeper"))
        # A gone parent (or no prctl) is noticed by the parent-pid check below: the final pass still runs.
        runtime.die_with_parent(parent, signal.SIGTERM, exit_if_gone=False)
        self()

    def request(self, why: str) -> None:
        """Safe in a signal handler: no logging here (the handler may interrupt a log call)."""
        if self.why is None:
            self.why = why
            # The agent repeats its SIGTERM every second; once finishing, the watchdog bounds the keeper.
            # Ignored, not handled: the interpreter's exit resets Python handlers to the default, and a
            # repeat landing then killed a keeper that had finished cleanly (exit -15, a false warning).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            watchdog = threading.Timer(self.grace_s, self._expire)
            watchdog.daemon = True
            watchdog.start()

    def _expire(self) -> None:
        log.error("did not finish within %.0f s of the stop request; exiting", self.grace_s)
        logging.shutdown()
        os._exit(1)

    def __call__(self) -> bool:
        if self.why is None and os.getppid() != self.parent:
            self.request(f"the agent (pid {self.parent}) is gone")
        if self.why is not None and not self.logged:
            self.logged = True
            log.info("stopping: %s (finishing within %.0f s)", self.why, self.grace_s)
        return self.why is not None


_NO_JOB = {
    "keeper.lock",
    "keeper.json",
    "job.lock",
    "persist.lock",
    "rollback.json",
    REPLICA_STATUS,
    REPLICAS_DIR,
    FETCHED,
    KEPT,
}


def holds_no_job(root: Path) -> bool:
    """True when ``root`` holds no snapshot nor job of its own: only locks, status and fetched or kept
    leftovers (or it is gone)."""
    try:
        return {p.name for p in root.iterdir()} <= _NO_JOB
    except (FileNotFoundError, NotADirectoryError):
        return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stalwart.checkpoint",
        description="Persist shared-memory snapshots of one job (the node's keeper).",
    )
    parser.add_argument("job_dir", type=Path)
    parser.add_argument("--poll-s", type=float, default=0.02)
    parser.add_argument(
        "--parent",
        type=int,
        default=None,
        help="the agent's pid: serve the directory while it lives (started by `stalwart run`)",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=30.0,
        help="with --parent: seconds to finish pending persists once asked to stop",
    )
    parser.add_argument("--status-copy", type=Path, default=None, help="also write the keeper's status here")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="with --parent: import torch and DCP at once (the workers will checkpoint), not at the first job",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    root = JobPaths(args.job_dir).root
    if args.parent is not None:
        stop = StopRequest(args.parent, args.grace_s)
        log.info("keeper for %s, serving agent pid %d", root, args.parent)
        # The replicator serves peers' copies from the start: with replicas on, the keeper imports at once
        replicas = int(os.environ.get(runtime.ENV_REPLICAS) or 0) > 0
        if not (args.eager or replicas) and next_job(root, stop, args.poll_s) is None and holds_no_job(root):
            shutil.rmtree(root, ignore_errors=True)  # stopped before any job: nothing of one to keep
            return 0
        from stalwart.checkpoint.keeper_serve import NodeJob, serve  # torch and DCP: only now a job needs them

        return serve(NodeJob(root), stop, args.poll_s, args.status_copy)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if root.parent == user_dir(root.parent.parent) and (stale := collect(root.parent.parent)):
        log.info("%s", stale)  # without an agent, the node's expired snapshots go when a keeper starts
    from stalwart.checkpoint.keeper_serve import serve_one

    serve_one(root, args.poll_s)
    return 0


def next_job(root: Path, stop: StopRequest, poll_s: float) -> dict[str, Any] | None:
    """Wait, importing nothing heavy, until workers write a job.json that names a storage (returned), or
    the agent stops this keeper first (None). Many jobs never checkpoint (a script under `stalwart run`):
    their keeper never pays torch's and DCP's imports (~5 CPU-s, ~0.3 GB) while it waits here."""
    while True:
        stopping = stop()
        root.mkdir(parents=True, exist_ok=True)
        if "storage" in (job := read_json(root / "job.json") or {}):
            return job
        if stopping:
            return None
        time.sleep(max(poll_s, 0.1))


class KeeperProcess:
    """The agent's handle on its node's keeper, like its zygote's: started before the workers, stopped
    (after pending persists, within ``grace_s``) when the agent exits; it also dies with the agent. One
    that exits before it is asked to (killed by the OOM killer, a crash) is replaced (``ensure``)."""

    REPLACE_EVERY_S = 5.0  # the first replacement waits this long after the last start; doubled after each
    REPLACE_AT_MOST = 5  # replacements that died within a minute in a row: then the agent stops trying

    def __init__(
        self,
        job: NodeJob,
        log_path: Path,
        grace_s: float = 30.0,
        env: dict[str, str] | None = None,
        eager: bool = False,
    ) -> None:
        self.job, self.log_path, self.grace_s, self.env, self.eager = job, log_path, grace_s, env or {}, eager
        self.status_copy = log_path.parent / "keeper-status.json"  # the keeper's status, kept for the report
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.replaced = 0  # keepers started after one exited on its own
        self._quick_deaths = 0  # replacements in a row that lived less than a minute
        self._spawned_at = 0.0

    def start(self) -> KeeperProcess:
        if not Path(shm_root := default_shm_root()).is_dir():  # no flash checkpoints here without another root
            log.warning("no %s: no keeper started for this job", shm_root)
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The keeper journals beside the status copy: a reused run directory's old records are not news.
        (self.status_copy.parent / INCIDENTS_FILE).unlink(missing_ok=True)
        self._spawn()
        return self

    def ensure(self) -> str | None:
        """Replace a keeper that exited while the agent still needs it; what happened, for the console.
        Without it every later persist of the job fails ("no keeper serves"), restart after restart. The
        new keeper takes the job over from shared memory and storage, as after a keeper killed mid-persist."""
        if self.proc is None or self.stopping or (code := self.proc.poll()) is None:
            return None
        lived = time.monotonic() - self._spawned_at
        if self._quick_deaths >= self.REPLACE_AT_MOST or lived < self.REPLACE_EVERY_S * 2**self._quick_deaths:
            return None  # backing off (a keeper that dies the same way each time), or given up
        self._quick_deaths = self._quick_deaths + 1 if self.replaced and lived < 60.0 else 0
        dead = self.proc.pid
        what = f"the node's keeper (pid {dead}) exited with {code} while the job ran"
        try:
            self._spawn()
        except (OSError, ShmPermissionError) as err:  # a full disk, no memory: the job trains on without one
            self._spawned_at = time.monotonic()
            return f"{what}; could not start another ({type(err).__name__}: {err}); retrying later"
        self.replaced += 1
        then = "" if self._quick_deaths < self.REPLACE_AT_MOST else "; if this one dies too, no other is started"
        replacement = f"replacement {self.replaced}{then}; see {self.log_path}"
        return f"{what}; started keeper pid {self.proc.pid} in its place ({replacement})"

    def _spawn(self) -> None:
        from stalwart.checkpoint.keeper_link import spawn_keeper  # the agent's side: torch is loaded there

        self.proc = spawn_keeper(
            self.job,
            self.log_path,
            parent=os.getpid(),
            grace_s=self.grace_s,
            status_copy=self.status_copy,
            env=self.env,
            eager=self.eager,
        )
        self._spawned_at = time.monotonic()

    def stop(self, wait_s: float | None = None) -> None:
        """SIGTERM: the keeper persists what is due, saves on failure, tidies and exits (it enforces
        ``grace_s`` itself; SIGKILL after a little more). ``wait_s``: wait only that long, then leave it
        finishing on its own (a preempted agent's exit must not wait)."""
        self.stopping = True
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._stop(wait_s)
        if self.proc.poll() is not None:
            self._tidy()

    def _stop(self, wait_s: float | None) -> None:
        assert self.proc is not None
        start = time.monotonic()
        self._wait_ready(start + (self.grace_s if wait_s is None else wait_s))
        if wait_s is not None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait_s)
            return
        deadline = start + self.grace_s + 5
        while True:
            # Again every second: in CI a keeper still starting when the job ended never acted on the
            # first one (no "stopping" in its log, nor its own watchdog) and cost the agent 35 s. Its
            # handler takes only the first request, so a repeat never cuts a final pass short.
            self.proc.terminate()
            try:
                self.proc.wait(max(0.0, min(1.0, deadline - time.monotonic())))
                return
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    break
        log.warning("keeper pid %d did not stop within %.0f s; killing it", self.proc.pid, self.grace_s + 5)
        self.proc.kill()
        self.proc.wait()

    def _tidy(self) -> None:
        """The directory this agent created for its keeper goes when the keeper left nothing of a job in
        it, also where the keeper could not remove it itself (killed or crashed before its final pass:
        CI16 and CI23 found such an empty directory of an evicted node)."""
        assert self.proc is not None and self.proc.returncode is not None
        if self.proc.returncode != 0:
            log.warning("keeper pid %d exited with %d; see %s", self.proc.pid, self.proc.returncode, self.log_path)
        if holds_no_job(self.job.root):
            remove(self.job.root)  # under its job lock; a directory already gone is left alone

    def _wait_ready(self, deadline: float) -> None:
        """A keeper still importing when a short job ended dies of SIGTERM without its final pass, and
        the job's snapshots stay in shm with nobody to say so: wait (bounded) until it catches SIGTERM
        (Linux: ``SigCgt`` in /proc; elsewhere no wait)."""
        assert self.proc is not None
        status = Path(f"/proc/{self.proc.pid}/status")
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                caught = next(line for line in status.read_text().splitlines() if line.startswith("SigCgt:"))
            except (OSError, StopIteration):
                return
            if int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
                return
            time.sleep(0.02)

    def kept(self) -> str | None:
        """What the console says when the keeper left the job's snapshots behind (with their expiry)."""
        return kept_line(self.job.root)

"""A worker's side of its node's keeper: start one where no agent runs it (and again when it dies), and
wait until it committed a step — telling a failing store, a step overwritten before anyone persisted
it, and a keeper that is gone from a slow commit. ``spawn_keeper`` is the only part of the keeper a
worker imports."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from stalwart.checkpoint.node_job import NodeJob
from stalwart.checkpoint.replicator import BEAT_FILE as REPLICA_BEAT
from stalwart.checkpoint.shm import REPLICA_STATUS, atomic_write, complete_slots, read_json, secure_job_dir
from stalwart.checkpoint.storage_health import FINAL_ATTEMPTS, StorageNews, StorageUnavailableError, not_durable

log = logging.getLogger("stalwart.checkpoint")
REPLICATED_TIMEOUT_S = 600.0  # a copy taking longer than this is given up on (the step goes on)
BEAT_STALE_S = 10.0  # the replicator's beat older than this: it is not running, nobody will copy


class KeeperLink:
    """``by_agent``: under ``stalwart run`` the agent runs the keeper, and this side only waits on it."""

    def __init__(
        self,
        job: NodeJob,
        rank: int,
        local_rank: int,
        *,
        by_agent: bool,
        log_path: str | Path | None,
        timeout_s: float,
        storage_news: StorageNews,
        node_ranks: list[int] | None = None,
    ) -> None:
        self.job, self.paths, self.rank, self.local_rank = job, job.paths, rank, local_rank
        self.node_ranks = node_ranks if node_ranks is not None else [rank]  # whose snapshots the keeper needs
        self.by_agent, self.log_path, self.timeout_s, self.storage_news = by_agent, log_path, timeout_s, storage_news
        self.proc: Any = None  # the keeper this worker started, if any
        self._checked = 0.0
        self._copy_news: str | None = None  # await_copies': what was said last

    def ensure(self) -> None:
        """Start a keeper if none serves the job (checked at most once a second)."""
        now = time.monotonic()
        if self.by_agent or now - self._checked < 1.0:
            return
        first, self._checked = self._checked == 0.0, now
        if self.proc is not None and self.proc.poll() is None:
            return  # ours is running (maybe still importing torch before it takes the lock)
        if not self.job.keeper_alive():
            if not first:
                log.warning("keeper for %s is not running; starting a new one", self.paths.root)
            self.proc = spawn_keeper(self.job, self.log_path)

    def await_decider(self, timeout_s: float = 30.0) -> None:
        """Across nodes without a master every node shares, the keepers find the checkpoint decider in
        the workers' store (``desk_host``): wait until this node's keeper did, so a failure in the
        job's first seconds is saved too."""
        deadline = time.monotonic() + timeout_s
        while not (read_json(self.paths.keeper_status) or {}).get("decider"):
            if time.monotonic() > deadline:
                log.warning("the keeper has not found the checkpoint decider in %g s; training on", timeout_s)
                return
            time.sleep(0.02)

    def await_copies(self, step: int, since: float) -> bool:
        """``--replica-sync``: wait for the copies of ``step`` (see ``wait_replicated``); True once they
        are out. The node's first rank says when copies stop or start reaching the peers, and why."""
        why = self.wait_replicated(step, since)
        if why != self._copy_news and self.local_rank == 0:  # said when it changes, not every step
            say = log.info if why in (None, "no peer") else log.warning
            say("step %d: %s", step, "copies reach the peers" if why is None else f"no peer copy ({why})")
        self._copy_news = why
        return why is None

    def wait_replicated(self, step: int, since: float, timeout_s: float = REPLICATED_TIMEOUT_S) -> str | None:
        """Return once the keeper copied this rank's snapshot of ``step`` (taken after ``since``) to the
        peers (None), or said it cannot (why: no peer yet, none took it). Waits while the keeper's
        replicator beats (``replicator.BEAT_FILE``): "not running" when it does not; "timeout" after
        ``timeout_s`` (a last resort: every push step is bounded by socket timeouts)."""
        t0 = last_look = time.monotonic()
        me = str(self.rank)
        while time.monotonic() - t0 < timeout_s:
            status = read_json(self.job.root / REPLICA_STATUS) or {}
            for kind in ("pushed", "skipped"):
                at, times = status.get(f"{kind}_step"), status.get(f"{kind}_times") or {}
                if at is not None and at >= step and (times.get(me) or 0) >= since:
                    return None if kind == "pushed" else str(status.get("skipped_why") or "not copied")
            if time.monotonic() - last_look >= 0.5 or last_look == t0:
                last_look = time.monotonic()
                try:
                    if time.time() - (self.job.root / REPLICA_BEAT).stat().st_mtime > BEAT_STALE_S:
                        return "the keeper's replicator is not running"
                except FileNotFoundError:
                    return "the keeper's replicator is not running"
            time.sleep(0.001)
        return "timeout"

    def rolled_back(self, step: int, timeout_s: float = 30.0) -> None:
        """Tell this node's keeper that a rollback to ``step`` moved storage's ``latest`` back (call after
        rank 0 deleted the newer checkpoints); the node's first rank writes the note and returns once
        the keeper took it, so no rank then trusts a ``last_committed`` of the abandoned future.
        A keeper that is not running needs no note: a new one starts from storage's ``latest``."""
        if self.local_rank != 0:
            return
        note = uuid.uuid4().hex
        try:
            atomic_write(self.paths.rollback_note, json.dumps({"step": step, "id": note}).encode())
        except OSError as err:  # the other ranks wait in a barrier: say it, do not leave them there
            log.warning("rollback to step %d: could not tell the keeper (%s); redone steps may not persist", step, err)
            return
        deadline = time.monotonic() + timeout_s
        while (read_json(self.paths.keeper_status) or {}).get("rollback") != note:
            if not self.job.keeper_alive():
                return
            if time.monotonic() > deadline:
                log.warning("rollback to step %d: the keeper did not take the note within %.0f s", step, timeout_s)
                return
            time.sleep(0.01)

    def node_holds(self, step: int) -> bool:
        """Every rank of this node still holds a complete snapshot of ``step``: the keeper persists only a
        step all of them hold. One rank's copy may be overwritten while another's is not (the keeper pins
        the ranks' slots one at a time, so a rank whose slot stayed pinned longer reuses its other slot
        sooner): judged by this rank's copy alone, that other rank waited the whole timeout for a persist
        nobody would make, while this one went on into the next collective (CI: a rollback hung)."""
        return all(any(s.step == step for s in complete_slots(self.paths, r)) for r in self.node_ranks)

    def wait_persisted(self, step: int, final: bool = False) -> None:
        """Return once the keeper committed ``step``. ``final``: storage failures are retried by the
        keeper (with backoff) up to ``FINAL_ATTEMPTS`` times before giving up; otherwise the first
        failure reported for ``step`` raises."""
        t0, spawned, gone_since, keeperless_since = time.monotonic(), 0, 0.0, 0.0
        while time.monotonic() - t0 < self.timeout_s:
            status = read_json(self.paths.keeper_status) or {}
            if final:
                self.storage_news.tell(status.get("storage"))
            if int(status.get("last_committed", -1)) >= step:
                return
            failed = [e for e in status.get("events", []) if e.get("step") == step and e.get("kind") == "failed"]
            if failed and (not final or len(failed) >= FINAL_ATTEMPTS):
                why = f"the keeper could not persist step {step} in {len(failed)} attempt(s)"
                raise not_durable(step, self.paths.root, status.get("storage"), why)
            for e in status.get("events", []):
                if e.get("step") == step and e.get("kind") == "skipped":
                    raise RuntimeError(f"the keeper could not persist step {step}: {e['detail']}")
            if not self.node_holds(step):
                # Newer snapshots overwrote it before the keeper took it (the keeper was still busy
                # with an older step): nobody will persist it, so waiting would only run out the timeout.
                # A grace period covers a keeper that had copied it and is committing.
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > 2.0:
                    raise RuntimeError(
                        f"step {step} is no longer held in memory by all of this node's ranks (overwritten "
                        "before the keeper persisted it)"
                    )
            if self.by_agent:
                keeperless_since = 0.0 if self.job.keeper_alive() else keeperless_since or time.monotonic()
                if keeperless_since and time.monotonic() - keeperless_since > 30.0:
                    raise RuntimeError(
                        f"no keeper serves {self.paths.root}: the agent's keeper is not running "
                        "(see keeper.log in the run directory)"
                    )
            elif self.local_rank == 0:
                before = self.proc
                self.ensure()
                spawned += self.proc is not before
                if spawned > 3:
                    raise RuntimeError(
                        f"the keeper keeps exiting before persisting step {step}; see "
                        f"{self.log_path or self.paths.root / 'keeper.log'}"
                    )
            time.sleep(0.02)
        raise StorageUnavailableError(
            f"step {step} was not persisted within {self.timeout_s} s (storage too slow?); see the keeper "
            f"log ({self.log_path or self.paths.root / 'keeper.log'})"
        )


_DROP_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_",
    "TORCH_NCCL_",
    "NCCL_ASYNC",
)


def spawn_keeper(
    job: NodeJob,
    log_path: str | Path | None,
    parent: int | None = None,
    grace_s: float | None = None,
    status_copy: Path | None = None,
    env: dict[str, str] | None = None,
    eager: bool = False,
) -> subprocess.Popen[bytes]:
    """Start a keeper in its own session (so signals to the workers' or the agent's process group miss
    it). With ``parent`` it serves the directory for as long as that process (the agent) lives;
    ``status_copy``: also keep its status there (it outlives the directory, for the job report);
    ``eager``: it imports torch and DCP at once, not when the first job comes (see keeper_process)."""
    secure_job_dir(job.root)
    extra, env = env or {}, {k: v for k, v in os.environ.items() if not k.startswith(_DROP_ENV)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    cmd = [sys.executable, "-m", "stalwart.checkpoint", str(job.root)]
    if parent is not None:
        cmd += ["--parent", str(parent)]
    if grace_s is not None:
        cmd += ["--grace-s", str(grace_s)]
    if status_copy is not None:
        cmd += ["--status-copy", str(status_copy)]
    if eager:
        cmd += ["--eager"]
    out = open(log_path or job.root / "keeper.log", "ab")
    try:
        return subprocess.Popen(
            cmd,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            close_fds=True,
        )
    finally:
        out.close()

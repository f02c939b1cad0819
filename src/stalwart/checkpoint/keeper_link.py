"""A worker's side of its node's keeper: start one where no agent runs it (and again when it dies), and
wait until it committed a step — telling a failing store, a step overwritten before anyone persisted
it, and a keeper that is gone from a slow commit."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from stalwart.checkpoint.durability import FINAL_ATTEMPTS, StorageNews, StorageUnavailableError, not_durable
from stalwart.checkpoint.node_job import NodeJob
from stalwart.checkpoint.replicator import STATUS_FILE as REPLICA_STATUS
from stalwart.checkpoint.shm import complete_slots, read_json

log = logging.getLogger("stalwart.checkpoint")
REPLICATED_TIMEOUT_S = 10.0  # no word from the keeper's replicator this long: it is not running


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
    ) -> None:
        self.job, self.paths, self.rank, self.local_rank = job, job.paths, rank, local_rank
        self.by_agent, self.log_path, self.timeout_s, self.storage_news = by_agent, log_path, timeout_s, storage_news
        self.proc: Any = None  # the keeper this worker started, if any
        self._checked = 0.0
        self._copy_wait_s, self._copy_news = REPLICATED_TIMEOUT_S, None  # await_copies' state

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
            self.proc = self.job.spawn_keeper(self.log_path)

    def wait_replicated(self, step: int, since: float, timeout_s: float = REPLICATED_TIMEOUT_S) -> str | None:
        """Return once the keeper copied the node's snapshot of ``step`` to its peers (None), or said it
        cannot (why: no peer yet, none took it) or said nothing for ``timeout_s`` ("timeout"). ``since``:
        the wall time the snapshot began; the keeper's news from before it is about an older trajectory."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = read_json(self.job.root / REPLICA_STATUS) or {}
            if (status.get("pushed_step") or -1) >= step and status.get("pushed_at", 0) >= since:
                return None
            if (status.get("skipped_step") or -1) >= step and status.get("skipped_at", 0) >= since:
                return str(status.get("skipped_why") or "not copied")
            time.sleep(0.001)
        return "timeout"

    def await_copies(self, step: int, since: float) -> None:
        """``--replica-sync``: wait for the copies of ``step`` (see ``wait_replicated``). A keeper that says
        nothing for 10 s turns the wait off for this worker; the node's first rank says when copies stop
        or start reaching the peers."""
        if not self._copy_wait_s:
            return
        why = self.wait_replicated(step, since, self._copy_wait_s)
        if why == "timeout":
            log.warning(
                "rank %d: the keeper said nothing of step %d's peer copy in %.0f s: this rank's steps no longer "
                "wait for copies (see keeper.log in the run directory)",
                *(self.rank, step, self._copy_wait_s),
            )
            self._copy_wait_s = 0.0
        elif why != self._copy_news and self.local_rank == 0:  # said when it changes, not every step
            log.info("step %d: %s", step, "copies reach the peers" if why is None else f"no peer copy ({why})")
        self._copy_news = why

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
            if all(slot.step != step for slot in complete_slots(self.paths, self.rank)):
                # Newer snapshots overwrote it before the keeper took it (the keeper was still busy
                # with an older step): nobody will persist it, so waiting would only run out the timeout.
                # A grace period covers a keeper that had copied it and is committing.
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > 2.0:
                    raise RuntimeError(
                        f"step {step} is no longer held in memory (overwritten before the keeper persisted it)"
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

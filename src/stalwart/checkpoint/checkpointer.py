"""The public API (usage: :mod:`stalwart.checkpoint`; docs/checkpoint.md, "Use"). ``save`` snapshots
every ``memory_every`` steps and marks every ``persist_every_steps``-th (or ``persist=True``) for the
node's keeper to persist, which also persists the newest every ``persist_every_s`` seconds. The
keeper is the agent's under ``stalwart run``, else the node's first local rank starts one (again if it dies).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from stalwart.checkpoint import shm
from stalwart.checkpoint.keeper_link import KeeperLink
from stalwart.checkpoint.node_job import NodeJob
from stalwart.checkpoint.peer_restore import gather, invalidate_replicas_after
from stalwart.checkpoint.restore import RestoreInfo, restore_state, roll_back
from stalwart.checkpoint.shm_gc import DEFAULT_KEEP_S
from stalwart.checkpoint.snapshot import SnapshotWriter
from stalwart.checkpoint.state import TrainingState
from stalwart.checkpoint.storage import Storage
from stalwart.checkpoint.storage_health import AtRiskPolicy, StorageNews, not_durable
from stalwart.runtime import ENV_REPLICA_SYNC, ENV_SHARED_MASTER, REPLICA_OVERLAP, worker_env
from stalwart.runtime.sigterm import finish_before_sigterm

log = logging.getLogger("stalwart.checkpoint")


def _setup_logging(rank: int) -> None:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[stalwart.ckpt rank {rank}] %(levelname)s %(message)s"))
        log.addHandler(handler)
        if log.level == logging.NOTSET:  # respect a level the application chose
            log.setLevel(logging.INFO)
        log.propagate = False


class Checkpointer:
    """Flash checkpoints of a dict of Stateful things; see the module docstring. Every rank constructs
    one (across nodes under plain ``torchrun`` the constructor is collective: the epoch is agreed)."""

    def __init__(
        self,
        dir: str,
        *,
        memory_every: int = 1,
        persist_every_steps: int = 0,
        persist_every_s: float = 0.0,
        keep_last: int = 3,
        keep_every: int = 0,
        shm_root: str | None = None,
        job_id: str | None = None,
        keeper: bool = True,
        keeper_idle_s: float = 120.0,
        keep_shm_s: float = DEFAULT_KEEP_S,
        keeper_log: str | Path | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        rng: bool = True,
        persist_timeout_s: float = 600.0,
        at_risk: AtRiskPolicy | None = None,
    ) -> None:
        for key, value, low in (
            ("memory_every", memory_every, 1),
            ("persist_every_steps", persist_every_steps, 0),
            ("persist_every_s", persist_every_s, 0),
            ("keep_last", keep_last, 1),
            ("keep_every", keep_every, 0),
            ("keeper_idle_s", keeper_idle_s, 1e-3),
            ("keep_shm_s", keep_shm_s, 0),
        ):
            if value < low:
                raise ValueError(f"checkpoint {key}={value} must be ≥ {low}")
        if persist_every_steps and persist_every_steps % memory_every:
            raise ValueError(
                f"checkpoint persist_every_steps={persist_every_steps} must be a multiple of "
                f"memory_every={memory_every}: only snapshotted steps can be persisted"
            )
        shm_root = shm_root or shm.default_shm_root()
        if not Path(shm_root).is_dir():
            raise ValueError(f"checkpoint shm_dir {shm_root!r} is not a directory; use a tmpfs such as /dev/shm")
        self.group = process_group
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        env = worker_env()
        self.local_rank = env.local_rank if dist.is_initialized() else 0
        self.epoch = env.epoch  # the execution this process belongs to: compared across nodes, never clocks
        # Unset (a hand-rolled launcher that sets only RANK/WORLD_SIZE): every rank is local, as before.
        local_world = (
            (env.local_world_size if "LOCAL_WORLD_SIZE" in os.environ else self.world) if dist.is_initialized() else 1
        )
        # Ranks on a node are contiguous (TorchElastic assigns them so); each node's keeper persists its own.
        first = self.rank - self.local_rank
        self.node_ranks = list(range(first, first + local_world))
        _setup_logging(self.rank)
        self.storage = Storage(dir, storage_options)
        self.memory_every, self.persist_every_steps = memory_every, persist_every_steps
        self.persist_every_s, self.use_keeper = persist_every_s, keeper
        self.rng = rng
        self.at_risk = at_risk if at_risk is not None else AtRiskPolicy()
        self._started_wall, self._risk_checked = time.time(), 0.0
        self.job = NodeJob(shm.job_dir_for(self.storage.url, shm_root, job_id))
        self.paths = self.job.paths
        if env.epoch_from_restarts and self.world > len(self.node_ranks):
            self.epoch = self._agree_epoch(env.restart_count)
        # Under `stalwart run` the agent runs the keeper of its job's default directory; we start one
        # only without an agent, or for a directory it does not serve (another shm root or job id).
        by_agent = (
            bool(env.under_agent and env.job_id and keeper)
            and self.job.root.resolve() == NodeJob.of_agent(env.job_id, env.node_id).root.resolve()
        )
        # Without an agent nobody else brings the keeper's storage incidents to the console.
        self.storage_news = StorageNews(self.storage.url, enabled=self.rank == 0 and not by_agent)
        self.keeper = KeeperLink(
            self.job,
            self.rank,
            self.local_rank,
            by_agent=by_agent,
            log_path=keeper_log,
            timeout_s=persist_timeout_s,
            storage_news=self.storage_news,
            node_ranks=self.node_ranks,
        )
        self._job_lock = self.job.attach()  # the keeper never removes files while we hold it
        self.paths.rank_dir(self.rank).mkdir(parents=True, exist_ok=True)
        self.paths.closed(self.rank).unlink(missing_ok=True)
        self.paths.kept.unlink(missing_ok=True)  # a job runs here again: no longer an ended job's
        shm.write_owner(self.paths, self.rank, self.world, self.epoch)
        if self.local_rank == 0:
            self.job.write_job(
                self.storage,
                self.world,
                self.node_ranks,
                {
                    "persist_every_steps": persist_every_steps,
                    "persist_every_s": persist_every_s,
                    "keep_last": keep_last,
                    "keep_every": keep_every,
                    "idle_s": keeper_idle_s,
                    "keep_shm_s": keep_shm_s,
                },
                keeper=keeper,
                keeper_log=keeper_log,
                epoch=self.epoch,
            )
            if not keeper and (persist_every_steps or persist_every_s):
                raise ValueError(
                    "persisting needs the keeper process; set keeper=True or both persist intervals to 0 (memory-only)"
                )
            if not keeper:
                log.warning(
                    "memory-only checkpoints (no keeper): snapshots survive a worker crash but not "
                    "a node loss, and nothing is written to %s",
                    self.storage.url,
                )
        slots = int(os.environ.get(shm.ENV_SLOTS) or len(shm.SLOTS))
        self.writer = SnapshotWriter(self.paths, self.rank, self.world, slots, epoch=self.epoch)
        self._forget_sigterm: Callable[[], None] = lambda: None
        # `stalwart run --replica-sync` of a job across nodes: a save returns once all copies are out;
        # `--replica-overlap`: once the previous save's are (``_copies_due``), so they overlap a step
        self.replica_wait = os.environ.get(ENV_REPLICA_SYNC, "") if self.world > len(self.node_ranks) else ""
        self._copies_due: tuple[int, float, bool] | None = None  # (step, since, started) of the last save
        # the newest step a lost node cannot take (every rank's snapshot of it is in a peer's memory); None:
        # no such step (copies trail, or none) since the start or the last restore
        self.safe_step: int | None = None
        self._bound: tuple[tuple[int, ...], TrainingState] | None = None
        self._hooked: set[int] = set()
        self._hooks: list[Any] = []
        self.pending_persist: int | None = None
        self.last_restore: RestoreInfo | None = None
        self.stats = {"saves": 0, "persist_requests": 0, "save_s": 0.0, "replica_wait_s": 0.0}
        if self.local_rank == 0 and self.use_keeper:
            # Now, not at the first save: it needs ~1 s to import torch, and the first persist-due steps
            # of a fast job would otherwise pass before it looks. After a restart it is usually still alive.
            self.keeper.ensure()
            spans_nodes = self.world > len(self.node_ranks)
            if spans_nodes and self.persisting and os.environ.get(ENV_SHARED_MASTER) != "1":
                self.keeper.await_decider()  # the decider is rank 0's keeper's (desk_host)
        # Last (a constructor that raised leaves SIGTERM as it was): the agent's SIGTERM (a peer failed)
        # lets a copy under way finish, else this rank would hold one step less.
        self._forget_sigterm = finish_before_sigterm(self.writer.finish_in_flight)

    def _agree_epoch(self, restart_count: int) -> int:
        """Plain ``torchrun`` across nodes: the agents' restart counts differ after one node's failure
        (docs/checkpoint.md, "Epochs, not clocks"). Every rank offers one more than its node's last
        execution (``job.json``, rewritten after this collective) and the largest wins, on a spare too."""
        last = self.job.job().get("epoch")
        return max(gather(max(restart_count, int(last) + 1 if last is not None else 0), self.group))

    # -- public API ----------------------------------------------------------------------------
    def _next_trajectory(self) -> tuple[int, int]:
        """A restore begins a later trajectory: the snapshots taken after it carry (epoch, restores), and
        the copies of an earlier one are not waited for."""
        self._copies_due, self.safe_step = None, None
        self.writer.restores += 1
        return self.epoch, self.writer.restores

    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest usable state into ``state``'s objects; returns the step to resume after
        (0 for a fresh start). Collective: every rank must call it."""
        tstate = self._bind(state)
        info = restore_state(
            tstate, self.paths, self.storage, self.rank, self.world, self.group, trajectory=self._next_trajectory()
        )
        self.last_restore = info
        if self.rank == 0:
            how = {"memory": "memory snapshot", "storage": "storage", "fresh": "nothing (fresh start)"}[info.source]
            log.info("restored from %s at step %d in %.3f s: %s", how, info.step, info.seconds, info.detail)
            for s in info.skipped:
                log.warning("restore skipped %s", s)
        return info.step

    def rollback(self, state: dict[str, Any], at_most: int, before: int) -> RestoreInfo:
        """Load the newest checkpoint at step ≤ ``at_most`` (memory or storage) into ``state`` (or, when
        there is none yet, the oldest one before ``before``) for a training-health rollback, deleting
        every newer snapshot and committed checkpoint (:func:`.restore.roll_back`). Raises
        LookupError when nothing can be restored. Collective: every rank must call it."""
        return roll_back(self, state, at_most, before)

    def discard_snapshots(self) -> int:
        """Start over: forget this rank's memory snapshots (they belong to an earlier trajectory and
        must never be paired with new ones). Returns 0, the step to start after. A storage directory
        holding committed steps is refused (ValueError): none of this run's steps up to its newest
        could be persisted, and a run's end would read that old step as its own."""
        if self.persisting and (held := gather(self.storage.committed() if self.rank == 0 else [], self.group)[0]):
            raise ValueError(
                f"checkpoint.dir {self.storage.url} holds committed step(s) {held} of an earlier run or attempt; with "
                "checkpoint.resume=false they are not resumed. Resume, use an empty dir, or remove them"
            )
        for s in shm.complete_slots(self.paths, self.rank):
            self.paths.slot(self.rank, s.slot, "json").unlink(missing_ok=True)
        invalidate_replicas_after(self.paths, -1, self._next_trajectory())  # and the peers' copies on this host
        if self.rank == 0:
            log.warning("not resuming (resume disabled): starting at step 0 in %s", self.storage.url)
        self.last_restore = RestoreInfo("fresh", 0, 0.0, "resume disabled")
        return 0

    def save(self, step: int, state: dict[str, Any], *, persist: bool | None = None) -> bool:
        """Snapshot ``state`` after optimizer step ``step`` if the policy says so (or ``persist=True``);
        returns True if a snapshot was started. Call it after ``optimizer.step()``."""
        t0 = time.perf_counter()
        if persist is None:
            persist = bool(self.persist_every_steps) and step % self.persist_every_steps == 0
        if not persist and step % self.memory_every:
            return False
        tstate = self._bind(state)
        for opt in tstate.optimizers:
            if id(opt) not in self._hooked:
                self._hooked.add(id(opt))
                self._hooks.append(opt.register_step_pre_hook(self._before_optimizer_step))
        if self._copies_due is not None:  # --replica-overlap: the previous save's copies, before a slot is reused
            self._wait_for_copies(*self._copies_due)
            self._copies_due = None
        since = time.time()
        started = self.writer.start(step, tstate.capture(), persist)
        if self.replica_wait == REPLICA_OVERLAP:
            self._copies_due = (step, since, started)
        elif self.replica_wait:
            self._wait_for_copies(step, since, started)
        if started and persist:
            self.pending_persist = step
            self.stats["persist_requests"] += 1
        self.stats["saves"] += started
        self.stats["save_s"] += time.perf_counter() - t0
        if self.local_rank == 0 and self.use_keeper:
            self.keeper.ensure()  # restarts a keeper that died
        self._check_at_risk(step)
        return started

    def _wait_for_copies(self, step: int, since: float, started: bool) -> None:
        """Return once every rank's snapshot of ``step`` is in a peer's memory (a node lost then costs no
        step: ``safe_step``), or nobody waits: a rank skipped its snapshot (slots busy), so its keeper
        never copies it. Every rank takes part in both collectives, whatever became of its own snapshot
        or copy; the second one also keeps a rank from going on before every rank's copy is out."""
        t0 = time.perf_counter()
        if started:
            self.writer.wait()
        copied = all(gather(started, self.group)) and self.keeper.await_copies(step, since)
        # a failed confirmation clears it: the copies of an older step may since have been overwritten
        self.safe_step = step if all(gather(copied, self.group)) else None
        self.stats["replica_wait_s"] += time.perf_counter() - t0

    @property
    def persisting(self) -> bool:
        """False for memory-only checkpoints (the user's choice): then nothing is required of storage."""
        return self.use_keeper and bool(self.persist_every_steps or self.persist_every_s)

    def storage_status(self) -> dict[str, Any] | None:
        """The keeper's view of storage (``StorageHealth.status``), None before it wrote one."""
        return (shm.read_json(self.paths.keeper_status) or {}).get("storage")

    def _check_at_risk(self, step: int) -> None:
        """Stop (``StorageUnavailableError``) when failing storage leaves more work at risk than the
        policy allows. Reads the keeper's status at most once a second."""
        now = time.time()
        if self.persisting and now - self._risk_checked >= 1.0:
            self._risk_checked = now
            status = self.storage_status()
            self.storage_news.tell(status)
            if (why := self.at_risk.violation(status, step, now, self._started_wall)) is not None:
                self.writer.wait()
                raise not_durable(step, self.paths.root, status, why)

    def ensure_durable(self, step: int) -> None:
        """Return only once ``step`` (the final one) is committed to storage; raise
        ``StorageUnavailableError`` naming the shared-memory copy when storage keeps failing it.
        A no-op for memory-only checkpoints. Call it after the last ``save``."""
        self.writer.wait()
        if not self.persisting:
            return
        status = shm.read_json(self.paths.keeper_status) or {}
        self.storage_news.tell(status.get("storage"))  # a recovery since the last step's check is said too
        if int(status.get("last_committed", -1)) >= step or (
            self.writer.stats["last_step"] != step and self._storage_has(step)
        ):  # restored from storage at the final step: the keeper may not look (ours it announces)
            return
        if all(s.step != step for s in shm.complete_slots(self.paths, self.rank)):
            raise not_durable(step, self.paths.root, self.storage_status(), "the final step is not in memory")
        self.pending_persist = step  # e.g. restored from memory at the final step: ask again
        self.keeper.wait_persisted(step, final=True)
        self.pending_persist = None

    def _storage_has(self, step: int) -> bool:
        """Storage's own ``latest`` is at ``step`` or later; False when storage cannot be read (an
        outage at the end of a job: the keeper's retries then decide, not this read)."""
        try:
            return (self.storage.latest() or -1) >= step
        except Exception as err:  # any store's client error (botocore's are not OSErrors)
            log.warning("could not read the latest committed step from %s: %r", self.storage.url, err)
            return False

    def wait(self, persist: bool = False) -> None:
        """Wait for the in-flight snapshot; with ``persist=True`` also until the keeper committed the
        last step requested for persistence and applied retention (``StorageUnavailableError`` when
        storage keeps failing it: see ``ensure_durable``, also for a final step restored from memory)."""
        self.writer.wait()
        if persist and self.pending_persist is not None and self.use_keeper:
            self.keeper.wait_persisted(self.pending_persist, final=True)
            self.pending_persist = None

    def wait_node_holds(self, step: int, timeout: float = 10.0) -> bool:
        """Wait until every rank of this node holds a complete snapshot of ``step`` (when this rank took
        one): a chaos fault "after step S" fires then, so a kill leaves S to save on failure whatever
        the ranks' pace. False after ``timeout`` (a peer skipped the step or is stuck)."""
        self.writer.wait()
        if self.writer.stats["last_step"] != step:
            return True  # no snapshot of this step here: nothing to wait for
        deadline = time.monotonic() + timeout
        while self.job.newest_agreed(self.world) < step:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, success: bool = True) -> None:
        """Finish the in-flight snapshot and remove the hooks. ``success=True`` tells the keeper this
        rank is done; when all are, it removes the snapshots (storage then holds the final state)."""
        try:
            self.writer.close()
        finally:
            self._forget_sigterm()
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            if success:
                shm.atomic_write(self.paths.closed(self.rank), json.dumps({"pid": os.getpid()}).encode())
                if not self.use_keeper:  # memory-only: nobody else cleans up; the last rank out does
                    shutil.rmtree(self.paths.rank_dir(self.rank), ignore_errors=True)
                    if not self.paths.ranks():
                        shutil.rmtree(self.paths.root, ignore_errors=True)
            if self._job_lock >= 0:
                os.close(self._job_lock)
                self._job_lock = -1

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(success=exc_type is None)

    # -- internals ------------------------------------------------------------------------------
    def _bind(self, state: dict[str, Any]) -> TrainingState:
        key = (id(state), *(id(v) for v in state.values()))
        if self._bound is None or self._bound[0] != key:
            self._bound = (key, TrainingState(state, self.rank, self.rng))
        return self._bound[1]

    def _before_optimizer_step(self, *_: Any) -> None:
        self.writer.wait_copied()

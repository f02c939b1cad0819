"""A node's shared-memory job in one place (docs/checkpoint.md "Tier 2: persistence"): its naming, locks,
``job.json``, the steps every rank agrees on, save-on-failure, and removing from storage what no checkpoint
needs (torn steps, failed attempts). Workers, the keeper and the agent all go through :class:`NodeJob`, so
the protocol between them lives here (the keeper process's lifetime: :mod:`.keeper_process`):

- ``job.json``: written by the node's first local rank (storage, ranks, policy); the keeper re-reads it.
- ``job.lock``: workers hold it shared while attached; files are removed only under it exclusively.
- ``keeper.lock``: held by the directory's one keeper (released by the kernel when it dies).
- ``persist.lock``: serialises persists (the keeper, the agent's save-on-failure, a rollback).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from stalwart import runtime
from stalwart.checkpoint.persist import remove_torn, write_checkpoint
from stalwart.checkpoint.replicas import replica_roots
from stalwart.checkpoint.shm import (
    JobPaths,
    atomic_write,
    complete_slots,
    job_dir_for,
    lock_held,
    read_json,
    read_json_cached,
    secure_job_dir,
)
from stalwart.checkpoint.snapshot import SnapshotView
from stalwart.checkpoint.storage import Storage, step_name
from stalwart.checkpoint.storage_health import StorageHealth

log = logging.getLogger("stalwart.checkpoint.keeper")


def agreed(steps: dict[int, dict[int, Any]]) -> set[int]:
    """The steps every rank in ``steps`` (rank → {step: header}) holds."""
    return set.intersection(*(set(v) for v in steps.values())) if steps else set()


def job_spans_nodes(job: dict[str, Any]) -> bool:
    """True when other nodes hold some of the job's ranks (``job.json`` lists this node's only)."""
    ranks, world = job.get("ranks"), job.get("world_size")
    return bool(ranks and world and len(ranks) < int(world))


class NodeJob:
    """A job's shared-memory directory on this node, and everything done to it as a whole."""

    def __init__(self, root: str | Path) -> None:
        self.paths = JobPaths(root)

    @classmethod
    def of_agent(cls, job_id: str, node_id: str) -> NodeJob:
        """The directory the agent's keeper serves: the default shm root, named by job and node id."""
        return cls(job_dir_for("", None, job_id, node_id))

    @property
    def root(self) -> Path:
        return self.paths.root

    # -- job.json: what the workers chose --------------------------------------------------------------
    def write_job(
        self,
        storage: Storage,
        world: int,
        ranks: list[int],
        policy: dict[str, Any],
        *,
        keeper: bool,
        keeper_log: str | Path | None,
        epoch: int = 0,
    ) -> None:
        """Written by the node's first local rank; the keeper learns storage and policy from it."""
        atomic_write(
            self.paths.job,
            json.dumps(
                {
                    "storage": storage.url,
                    "storage_options": storage.options,
                    "world_size": world,
                    "ranks": ranks,
                    "policy": policy,
                    "keeper": keeper,
                    "keeper_log": str(Path(keeper_log).absolute()) if keeper_log else None,
                    "epoch": epoch,  # the execution of the workers that wrote it
                    "agent": os.environ.get(runtime.ENV_AGENT, ""),  # ... under this launch of the agent
                    "store": _workers_store(),  # where rank 0's keeper says where the decider is (desk_host)
                }
            ).encode(),
        )
        os.chmod(self.paths.job, 0o600)  # storage options may carry credentials

    def job(self) -> dict[str, Any]:
        """``job.json`` (read only), parsed again only when it changed: the keeper asks many times a second."""
        return read_json_cached(self.paths.job) or {}

    def persists(self) -> bool:
        """False for memory-only checkpoints (no keeper wanted, nothing to persist), or no job yet."""
        job = self.job()
        policy = job.get("policy") or {}
        return bool(job.get("keeper", True) and (policy.get("persist_every_steps") or policy.get("persist_every_s")))

    def spans_nodes(self) -> bool:
        """True when other nodes hold some of the job's ranks (``job.json`` lists this node's only)."""
        return job_spans_nodes(self.job())

    # -- the steps held ---------------------------------------------------------------------------------
    def world(self) -> int | None:
        """The world size of the newest attached workers (the newest owner record): after a regrouping moved
        this node to another rank, the old rank's record names a world that hides the new rank's snapshots."""
        owners = [o for r in self.paths.ranks() if (o := read_json_cached(self.paths.owner(r)))]
        newest = max(owners, key=lambda o: float(o.get("time") or 0), default=None)
        return int(newest["world_size"]) if newest else None

    def node_ranks(self, world: int) -> list[int]:
        """The ranks whose snapshots this node holds (all of them on a single-node job)."""
        ranks = self.job().get("ranks")
        return [int(r) for r in ranks] if ranks else list(range(world))

    def snapshot_steps(self, world: int, ranks: list[int] | None = None) -> dict[int, dict[int, dict[str, Any]]]:
        """rank → {step: header} of complete snapshots taken at this world size (this node's ranks)."""
        return _steps_at(self.paths, ranks if ranks is not None else range(world), world)

    def copy_steps(self, world: int) -> dict[int, dict[int, dict[str, Any]]]:
        """rank → {step: header} of the peer copies (replicas) this node holds of other nodes' ranks."""
        out: dict[int, dict[int, dict[str, Any]]] = {}
        for root in replica_roots(self.root):
            paths = JobPaths(root)
            for r, steps in _steps_at(paths, paths.ranks(), world).items():
                if steps:
                    out[r] = {**steps, **out.get(r, {})}  # two sources of one rank (a regroup): the first
        return out

    def epoch(self) -> int:
        """The execution this node's workers ran last (``job.json``'s, written at each start); not the
        snapshots' (one restored from an earlier launch names that launch's execution)."""
        return int(self.job().get("epoch", 0))

    def newest_agreed(self, world: int) -> int:
        """The newest step all of this node's ranks hold at ``world`` ranks, or -1."""
        return max(agreed(self.snapshot_steps(world, self.node_ranks(world))), default=-1)

    # -- locks ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def persist_lock(self) -> Iterator[None]:
        """Serialise persists of one job (keeper, an agent's save-on-failure, a rollback's deletes)."""
        fd = os.open(self.paths.persist_lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def attach(self) -> int:
        """Hold the job lock shared for the life of a worker (returns the fd). Retries if the keeper
        removed the directory between our open and our lock, so the lock is always on the live file."""
        while True:
            secure_job_dir(self.root)
            fd = os.open(self.paths.job_lock, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.fstat(fd).st_ino == os.stat(self.paths.job_lock).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def closed(self, rank: int, owner: dict[str, Any] | None) -> bool:
        """Rank ``rank``'s worker ``owner`` closed its checkpointer: it ended, it did not die."""
        closed = read_json(self.paths.closed(rank))
        return bool(owner and closed and closed.get("pid") == owner.get("pid"))

    def workers_attached(self) -> bool:
        """True while some worker holds the job lock (released by the kernel when it dies)."""
        return self._held(self.paths.job_lock)

    def keeper_alive(self) -> bool:
        return self._held(self.paths.keeper_lock)

    def try_lock(self, path: Path) -> int | None:
        """The fd of ``path`` locked exclusively, or None when someone holds it."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
            return None

    def _held(self, path: Path) -> bool:
        return self.root.is_dir() and lock_held(path)

    # -- persisting ---------------------------------------------------------------------------------------
    def persist_step(self, storage: Storage, step: int, world: int, source: str) -> dict[str, Any]:
        """Pin every rank's snapshot of ``step`` and commit them as one checkpoint (one node; across nodes:
        ``decider_actor``). The manifest has ``already: True`` when a committed checkpoint covers the step
        (the keeper and the agent's save-on-failure may race). LookupError/BlockingIOError: a snapshot is gone."""
        views: dict[int, SnapshotView] = {}
        with self.persist_lock():
            try:
                done = storage.committed()  # decided under the lock: never rewrite what another persist committed
                if done and done[0] >= step:
                    return {**(storage.manifest(done[0]) or {}), "already": True, "commit_s": 0.0}
                for r in range(world):
                    views[r] = open_pinned([self.paths], r, lambda i: i.step == step, f"step {step}")
                return write_checkpoint(storage, step, [views[r] for r in range(world)], source)
            finally:
                for v in views.values():
                    v.close()

    def save_on_failure(
        self,
        storage_url: str | None = None,
        storage_options: dict[str, Any] | None = None,
        world_size: int | None = None,
        quiet: bool = False,
    ) -> dict[str, Any]:
        """Persist the newest snapshot every rank holds, unless already committed: the keeper's or the agent's
        when a worker of a one-node job dies (across nodes the decider plans it). Never a step some rank lacks
        (that would mix states of different steps); the result and the log say why nothing was done."""
        job = self.job()
        storage = Storage(
            storage_url or job["storage"],
            storage_options if storage_options is not None else job.get("storage_options"),
        )
        world = world_size or self.world()

        def outcome(persisted: bool, step: int | None, detail: str, covered: bool = False) -> dict[str, Any]:
            if not quiet:
                (log.info if persisted else log.warning)("save-on-failure: %s", detail)
            return {"persisted": persisted, "step": step, "detail": detail, "covered": covered}

        if not world:
            return outcome(False, None, f"no snapshots under {self.root}")
        if len(ranks := self.node_ranks(world)) < world:
            return outcome(False, None, f"this node holds ranks {ranks} of {world}: the decider saves across nodes")
        covered = "step {} is already covered by committed step {}"
        steps = self.snapshot_steps(world, ranks)
        if not (common := agreed(steps)):
            held = ", ".join(f"rank {r}: {sorted(s) or 'none'}" for r, s in steps.items())
            return outcome(False, None, f"ranks do not agree on a step ({held}); nothing persisted")
        step = max(common)
        committed = storage.committed()  # unlocked: a covered step need not wait for a persist under way
        if committed and committed[0] >= step:
            return outcome(False, step, covered.format(step, committed[0]), True)
        manifest = self.persist_step(storage, step, world, "save-on-failure")
        if manifest.get("already"):
            return outcome(False, step, covered.format(step, manifest.get("step")), True)
        return outcome(
            True,
            step,
            f"persisted step {step} ({manifest['bytes'] / 2**20:.1f} MiB in "
            f"{manifest['commit_s']:.2f} s) to {storage.path(step_name(step))}",
        )


def open_pinned(roots: list[JobPaths], rank: int, match: Callable[[Any], bool], what: str) -> SnapshotView:
    """``rank``'s first complete snapshot in ``roots`` that ``match``es, opened under a shared lock. The
    writer publishes a header just before it releases the slot, so a busy slot that still matches is
    retried for a second; one being overwritten has lost its header (LookupError)."""
    deadline = time.monotonic() + 1.0
    while True:
        found = next(((root, i) for root in roots for i in complete_slots(root, rank) if match(i)), None)
        if found is None:
            raise LookupError(f"rank {rank} no longer holds {what} on this node")
        try:
            return SnapshotView(*found)
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _workers_store() -> str | None:
    """The workers' rendezvous store (``MASTER_ADDR:MASTER_PORT``), None outside torchrun and its kin."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else None


def _steps_at(paths: JobPaths, ranks: Iterable[int], world: int) -> dict[int, dict[int, dict[str, Any]]]:
    """rank → {step: header} of the complete slots under ``paths`` taken at ``world`` ranks."""
    return {
        r: {s.step: s.header for s in reversed(complete_slots(paths, r)) if s.header.get("world_size") == world}
        for r in ranks
    }


def save_on_failure(
    job_dir: str | Path,
    storage_url: str | None = None,
    storage_options: dict[str, Any] | None = None,
    world_size: int | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """:meth:`NodeJob.save_on_failure` of the job in ``job_dir``."""
    return NodeJob(job_dir).save_on_failure(storage_url, storage_options, world_size, quiet)


Event = Callable[..., None]  # the keeper's event(kind, step, detail, level)


def tidy_storage(node: NodeJob, storage: Storage, event: Event, health: StorageHealth, across: bool = False) -> None:
    """At the keeper's start (rank 0's node): remove torn step directories; with ``across`` (a job across
    nodes) only those older than ``latest``: a newer one may be a plan other nodes' keepers write now
    (this may be a spare's keeper, joining mid-save), which the decider's ``GiveUp`` tidies if it fails; the
    persist lock is node-local."""
    try:
        with node.persist_lock():
            latest = storage.latest()
            below = (latest if latest is not None else -1) if across else None
            for s in storage.remove_uncommitted(below):
                why = f"{step_name(s)} had no manifest (a persist died mid-write; latest is {latest})"
                event("removed-torn", s, why, logging.WARNING)
    except Exception as err:  # unreachable storage: the first persist will report it too
        health.failed("tidy", None, err)


def remove_leftovers(storage: Storage, leftovers: set[int], event: Event) -> None:
    """Storage works again: remove the failed attempts that could not be removed when they failed."""
    for step in sorted(leftovers):
        if remove_torn(storage, step):
            leftovers.discard(step)
            event("removed-torn", step, "a failed attempt, removed now that storage works again")

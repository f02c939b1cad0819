"""The keeper: one process per node and job that outlives the workers. It persists the shared-memory
snapshots (:mod:`.persist`; across nodes as the decider says, :mod:`.decider_actor`), saves on failure
when a worker dies and removes the snapshots when the job completes, never blocking training (a
snapshot overwritten before it is pinned is skipped; steps due meanwhile coalesce into the newest).
Its lifetime: :mod:`.keeper_process`. See docs/checkpoint.md, "Tier 2: persistence".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart import chaos, runtime
from stalwart.checkpoint.decider_actor import Outcome, reporter
from stalwart.checkpoint.desk_host import LOOK_EVERY_S, DeskHost, Membership
from stalwart.checkpoint.node_job import NodeJob, agreed, job_spans_nodes, remove_leftovers, tidy_storage
from stalwart.checkpoint.persist import remove_torn, retention
from stalwart.checkpoint.shm import atomic_write, pid_alive, read_json, read_json_cached
from stalwart.checkpoint.shm_gc import DEFAULT_KEEP_S, mark_kept
from stalwart.checkpoint.snapshot import captured_at
from stalwart.checkpoint.storage import Storage, step_name
from stalwart.checkpoint.storage_health import INCIDENTS_FILE, StorageHealth

if TYPE_CHECKING:
    from stalwart.checkpoint.keeper_process import StopRequest

log = logging.getLogger("stalwart.checkpoint.keeper")


class Keeper:
    """Serves one job in a directory: persists agreed snapshots per policy, saves on failure, tidies."""

    def __init__(
        self, node: NodeJob, poll_s: float = 0.02, stop: StopRequest | None = None, status_copy: Path | None = None
    ) -> None:
        self.node, self.paths, self.poll_s, self.stop = node, node.paths, poll_s, stop
        self.status_copy = status_copy  # the agent's: outlives the job directory (job report)
        self.job: dict[str, Any] = {}
        self.handled_pids: set[int] = set()
        self.given_up: dict[int, float | None] = {}  # a step given up → its snapshot's capture time (None: none)
        self.events: list[dict[str, Any]] = []
        self.status: dict[str, Any] = {"pid": os.getpid(), "started": time.time()}
        self.leftovers: set[int] = set()  # failed attempts whose removal failed too: removed later
        self.members = Membership.from_env()  # the decider in the master every node shares (`stalwart run`)
        # No master every node shares (plain torchrun): rank 0's keeper hosts the decider.
        self.desk = DeskHost(self.paths, os.environ.get(runtime.ENV_AGENT, "")) if self.members is None else None
        if not self._reload_job():
            raise ValueError(f"{self.paths.job} is missing or has no storage URL")
        self.actor = reporter(self.members, self.paths, lambda: self.coordinator)
        self.last_persist_time = time.monotonic()

    def _reload_job(self) -> bool:
        """Take ``job.json`` again if it changed (new workers may choose other storage or policy): the
        node's cached parse is a new object only then. Returns whether a usable one was loaded."""
        job = self.node.job()
        if job is self.job or "storage" not in job:
            return False
        before, self.job = self.job, job
        if (job["storage"], job.get("storage_options")) != (before.get("storage"), before.get("storage_options")):
            self.storage = Storage(job["storage"], job.get("storage_options"))
            self.storage.refresh()
            self.last_persisted = self.storage.latest() or -1
            journal = (self.status_copy.parent if self.status_copy else self.paths.root) / INCIDENTS_FILE
            self.health = StorageHealth(self.storage.url, journal)
            self.health.last_committed = self.last_persisted
            self.given_up.clear()
            self.status["last_committed"] = self.last_persisted
            if before:
                self.event("storage", None, f"the workers now checkpoint to {self.storage.url}")
        # Multi-node: this node's ranks; only the keeper on rank 0's node decides, commits and tidies.
        self.coordinator = not job.get("ranks") or 0 in job["ranks"]
        self.active = bool(job.get("keeper", True))  # memory-only: the workers wanted no keeper
        return True

    def event(self, kind: str, step: int | None, detail: str, level: int = logging.INFO) -> None:
        log.log(level, "%s%s: %s", kind, f" step {step}" if step is not None else "", detail)
        self.events = ([*self.events, {"time": time.time(), "kind": kind, "step": step, "detail": detail}])[-50:]
        status = {"last_committed": self.last_persisted, "storage": self.health.status()}
        self.status.update(events=self.events, leftovers=sorted(self.leftovers), **status)
        atomic_write(self.paths.keeper_status, json.dumps(self.status).encode())
        if self.status_copy is not None:
            atomic_write(self.status_copy, json.dumps({"storage": self.status["storage"]}).encode())

    def _follow_rollback(self) -> None:
        """A rollback deleted committed steps newer than its target and moved ``latest`` back: forget
        what was persisted of the abandoned future, or its redone steps (same numbers) would never be
        persisted and ``last_committed`` would tell waiters they were. Acknowledged in the status."""
        note = read_json(self.paths.rollback_note)
        if not note or not note.get("id") or note["id"] == self.status.get("rollback"):
            return
        try:
            self.storage.refresh()
            latest = self.storage.latest()
        except Exception as err:  # storage down: nothing newer than the rollback's step is left there
            latest = min(self.last_persisted, int(note.get("step", -1)))
            log.warning("rollback: cannot read storage's latest (%r); assuming step %d", err, latest)
        self.last_persisted = self.health.last_committed = latest if latest is not None else -1
        self.given_up = {s: t for s, t in self.given_up.items() if s <= self.last_persisted}
        # The abandoned steps' events carry the redone steps' numbers: a waiter would read them as its own.
        self.events = [e for e in self.events if e.get("step") is None or e["step"] <= self.last_persisted]
        self.status["rollback"] = note["id"]
        if self.actor is not None and self.actor.link.formed:
            self.actor.rolled_back(self.node.epoch(), self.last_persisted)
        self.event("rollback", note.get("step"), f"storage moved back to step {latest}: redone steps persist again")

    def policy(self, key: str, default: Any = 0) -> Any:
        return self.job.get("policy", {}).get(key, default)

    def run(self) -> bool:
        """Serve until the job ends, its directory goes, it idles out or is stopped; False: another keeper serves."""
        lock = self.node.try_lock(self.paths.keeper_lock)
        if lock is None:
            log.info("another keeper already serves %s", self.paths.root)
            return False
        try:
            self._serve()
        finally:
            if self.desk is not None:
                self.desk.close()
            os.close(lock)
        return True

    def _serve(self) -> None:
        self.event(
            "start",
            None,
            f"keeper pid {os.getpid()} for {self.paths.root} → {self.storage.url} "
            f"(latest committed: {self.last_persisted if self.last_persisted >= 0 else 'none'})",
        )
        if self.coordinator:  # rank 0's node: the committer of a step the others' keepers write
            tidy_storage(self.node, self.storage, self.event, self.health, across=job_spans_nodes(self.job))
        idle_since: float | None = None
        while True:
            if not self.paths.root.is_dir():
                log.info("job directory %s removed", self.paths.root)
                return
            self._reload_job()
            self._find_decider()
            self._follow_rollback()
            if self.stop is not None and self.stop():
                self._final_pass()
                return
            world = self.node.world()
            ranks = self.node.node_ranks(world) if world else []
            owners = {r: read_json_cached(self.paths.owner(r)) for r in ranks}
            if (
                world
                and self.active
                and all(self.node.closed(r, o) for r, o in owners.items())
                and self._finish(world, "all ranks closed the checkpointer: job complete", complete=True)
            ):
                return
            if self.members is not None and 0 < len(ranks) < world:  # every node's ranks form the execution
                self.members.report_member(self.node.epoch(), ranks, world, self.job.get("agent", ""))
            if self.active and world:
                self._check_failures(world, owners)
                self._maybe_persist(world, ranks)
            if self.stop is None:  # without an agent, nobody else ends the keeper
                attached = self.node.workers_attached()
                idle_since = None if attached else (idle_since or time.monotonic())
                idle_s = float(self.policy("idle_s", 120.0))
                if idle_since is not None and time.monotonic() - idle_since > idle_s:
                    if self._finish(world or 0, f"no worker attached for {idle_s} s"):
                        return
                    idle_since = None
            time.sleep(self.poll_s)

    def _find_decider(self) -> None:
        """Across nodes without a shared master: the decider rank 0's keeper hosts (``desk_host``). The
        host puts its address into every new store of the workers (a restart's); the others look again
        while their calls fail (a restarted host keeper listens elsewhere, with another token)."""
        if self.desk is None or not job_spans_nodes(self.job):
            return
        if self.actor is not None and self.desk.master is not None:
            self.desk.republish(self.job)
            return
        if self.actor is not None and not self.actor.link.failing:
            return
        members = self.desk.members(self.job, self.coordinator, 1.0 if self.actor is not None else LOOK_EVERY_S)
        if members is None or (self.members is not None and members.address == self.members.address):
            return
        if self.actor is not None:  # its plans end with it; the new host's decider hears this node afresh
            self.actor.end(job_complete=False, wait_s=0.0)
        self.members = members
        self.actor = reporter(members, self.paths, lambda: self.coordinator)
        self.status["decider"] = members.address  # the workers' first save waits for it (KeeperLink)
        where = "hosted here" if self.desk.master is not None else "rank 0's keeper's"
        self.event("decider", None, f"node {members.me}: the checkpoint decider is {where}, at {members.address}")

    def _final_pass(self) -> None:
        """The agent exits or is gone: once its workers are gone too (they die with it), save on
        failure for those that did not close, persist what is due, and remove what storage holds."""
        assert self.stop is not None
        deadline = time.monotonic() + min(10.0, self.stop.grace_s / 3)
        while self.node.workers_attached() and time.monotonic() < deadline:
            time.sleep(0.05)
        world = self.node.world()
        if not (self.active and world):
            return
        owners = {r: read_json(self.paths.owner(r)) for r in self.node.node_ranks(world)}
        self._check_failures(world, owners)
        self._maybe_persist(world, list(owners), force=True)
        self._finish(world, self.stop.why or "stopped", all(self.node.closed(r, o) for r, o in owners.items()))

    def _check_failures(self, world: int, owners: dict[int, dict[str, Any] | None]) -> None:
        across = len(owners) < world  # the decider saves from every node's final holdings
        if across and self.actor is None:
            return  # not linked to the decider yet: a death seen then is reported once linked
        for r, owner in owners.items():
            if not owner or owner.get("world_size") != world or self.node.closed(r, owner):
                continue
            pid = int(owner["pid"])
            if pid in self.handled_pids or pid_alive(pid):
                continue
            self.handled_pids.add(pid)
            if across:
                self.event("worker-died", None, f"rank {r} (pid {pid}) died; the decider saves", logging.WARNING)
                continue
            self.event("worker-died", None, f"rank {r} (pid {pid}) died; saving on failure", logging.WARNING)
            try:
                result = self.node.save_on_failure(self.storage.url, self.job.get("storage_options"), world, True)
            except Exception as err:
                cause = self.health.failed("save-on-failure", None, err)
                self.event("save-on-failure-failed", None, f"({cause}) {err!r}", logging.ERROR)
                continue
            if result["persisted"]:
                self.health.committed(result["step"])
                self._retention(result["step"])
                self.last_persisted = max(self.last_persisted, result["step"])
            self.event("save-on-failure", result["step"], result["detail"])
        if across:
            self.actor.workers_died(self.node, world, owners, self.handled_pids)

    def _maybe_persist(self, world: int, ranks: list[int], force: bool = False) -> None:
        """Persist what the policy says is due. While storage fails, attempts back off and each retry
        takes the newest step in memory (``force``: one attempt now, the final pass)."""
        steps = self.node.snapshot_steps(world, ranks)
        common = agreed(steps)
        taken = {s: captured_at(steps[ranks[0]][s]) for s in common}
        # Workers restarted from an older snapshot redo the steps after it, under the same numbers: a
        # step skipped (or abandoned) for the snapshot it had then is the new snapshot's to persist.
        self.given_up = {s: t for s, t in self.given_up.items() if t is None or taken.get(s, t) == t}
        flagged = [s for s in common if all(steps[r][s].get("persist") for r in steps)]
        every, every_s = int(self.policy("persist_every_steps")), float(self.policy("persist_every_s"))
        if len(ranks) < world:  # across nodes: the decider plans, the keepers act (decider_actor)
            if self.actor is not None:
                if self.coordinator and (due := self.actor.due_by_time(common, every_s, self.last_persisted)):
                    flagged = sorted({*flagged, due})
                self.actor.observe(steps, flagged, self.node.copy_steps(world))
                self._acted(self.actor.act(self.storage, world), taken)
            return
        if not (force or self.health.may_try()):
            return
        target = max(flagged, default=-1)
        if self.health.streak and (every or every_s):
            target = max(common, default=-1)  # a retry: the newest state in memory
        if target <= self.last_persisted or target in self.given_up:
            target = -1
            newest = max(common, default=-1)
            if every_s > 0 and time.monotonic() - self.last_persist_time >= every_s and newest > self.last_persisted:
                target = newest
        if target < 0:
            return
        due = [s for s in range(max(1, self.last_persisted + 1), target) if every > 0 and s % every == 0]
        if due and not self.health.streak:  # while storage fails, the retries say why steps are skipped
            self.event(
                "coalesced",
                target,
                f"persist of step(s) {due} was due while the previous persist "
                f"ran or before the keeper saw it; persisting step {target} instead",
                logging.WARNING,
            )
        self.last_persist_time = time.monotonic()
        try:
            manifest = self.node.persist_step(self.storage, target, world, "keeper")
        except (LookupError, BlockingIOError) as err:
            self.given_up[target] = taken.get(target)
            why = f"{err}: training outpaced persistence; the next due step will be persisted"
            self.event("skipped", target, why, logging.WARNING)
            return
        except Exception as err:  # storage: retried with backoff (not given up), torn attempt removed
            cause = self.health.failed("persist", target, err)
            if not remove_torn(self.storage, target):
                self.leftovers.add(target)
            self.event("failed", target, f"persist failed ({cause}): {err!r}", logging.DEBUG)
            return
        self.health.committed(target)
        remove_leftovers(self.storage, self.leftovers, self.event)
        if manifest.get("already"):
            self.last_persisted = target
            self.event("already-committed", target, f"committed step {manifest.get('step')} covers it")
            return
        # Retention before the commit is announced (``last_committed``): a worker's wait(persist=True)
        # then finds storage as the policy leaves it, and a rollback that follows sees no step about to go.
        self._retention(target)
        self.last_persisted = target
        mib = manifest["bytes"] / 2**20
        self.event(
            "committed",
            target,
            f"{mib:.1f} MiB in {manifest['commit_s']:.2f} s "
            f"({mib / max(manifest['commit_s'], 1e-9):.0f} MiB/s) → "
            f"{self.storage.path(step_name(target))}",
        )

    def _acted(self, outcomes: list[Outcome], taken: dict[int, float]) -> None:
        """What the decider's plans came to on this node (``decider_actor``)."""
        for kind, step, what in outcomes:
            if kind == "given-up":
                self.given_up[step] = taken.get(step)
                self.event("skipped", step, f"{what}; the next due step will be persisted", logging.WARNING)
            elif kind == "failed":
                self.event("failed", step, f"persist failed ({self.health.failed('persist', step, what)}): {what!r}")
            elif step > self.last_persisted:
                self.health.committed(step)
                self._retention(step)
                self.last_persisted = step
                self.event("committed", step, f"{what['bytes'] / 2**20:.1f} MiB → {self.storage.path(step_name(step))}")

    def _retention(self, step: int) -> None:
        """Apply keep_last/keep_every after committing ``step``, under the persist lock (a rollback
        deletes and moves ``latest`` under it too)."""
        if not self.coordinator:
            return
        try:
            if fault := chaos.due("retention", step=step):
                fault.fire()
            with self.node.persist_lock():
                removed = retention(self.storage, int(self.policy("keep_last", 3)), int(self.policy("keep_every", 0)))
        except Exception as err:
            cause = self.health.failed("retention", step, err)
            self.event("retention-failed", step, f"({cause}) {err!r}", logging.DEBUG)
            return
        if removed:
            log.info("retention removed step(s) %s", removed)

    def _finish(self, world: int, why: str, complete: bool = False) -> bool:
        """Stop serving, removing the snapshots if storage has everything they hold (otherwise keep them
        and say so). Returns False — keep running — if a worker attached meanwhile (a restart)."""
        lock = self.node.try_lock(self.paths.job_lock)
        if lock is None:
            return False
        try:
            newest = self.node.newest_agreed(world) if world else -1
            self.storage.refresh()
            latest = self.storage.latest() or -1
            if newest > latest:
                kept = mark_kept(self.paths, float(self.policy("keep_shm_s", DEFAULT_KEEP_S)), why, newest)
                self.event(
                    "exit",
                    newest,
                    f"{why}; step {newest} is newer than the last committed checkpoint ({latest}): {kept}; "
                    f"`stalwart ckpt persist-from-memory {self.paths.root}` persists it",
                    logging.WARNING,
                )
            else:
                self.event("exit", None, f"{why}; removing {self.paths.root}")
                shutil.rmtree(self.paths.root, ignore_errors=True)
        finally:
            os.close(lock)
        if self.actor is not None:  # outside the job lock: a restarting worker must not wait on the master
            self.actor.end(complete)
        return True

"""The keeper's side of the decider in a job across nodes (docs/protocol.md, "Decisions" and step 3), so
storage carries no coordination. :class:`Reporter` sends the node's reports (holdings, steps due, pins on
sight, workers gone, the job's end); :class:`Actor` acts: on ``Persist`` it pins the ranks ``writers`` gives
this node (its own, or a lost node's peer copies) and puts their entry tables beside the step (``plan_write``),
``Pinned``; on ``Write`` it writes its share, ``Wrote``; the node writing rank 0 commits on ``Commit``,
``Committed``; ``Release``/``GiveUp`` unpin. :meth:`Actor.act` runs each tick in the keeper loop, writes
included. On a failure the agent waits for ``RestartMayProceed`` (:func:`await_restart`) instead of saving.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint import plan_write
from stalwart.checkpoint.decider_link import DeciderLink
from stalwart.checkpoint.desk_host import Membership
from stalwart.checkpoint.node_job import NodeJob, open_pinned
from stalwart.checkpoint.replicas import host_roots
from stalwart.checkpoint.shm import JobPaths, complete_slots, pid_alive, pin_slot
from stalwart.checkpoint.snapshot import SnapshotView, epoch_of
from stalwart.checkpoint.storage import Storage

log = logging.getLogger("stalwart.checkpoint.keeper")
HOLDING_EVERY_S = 1.0  # holdings that change no step due are reported at most this often
SIGHT_MAX_S = 10.0  # a pin on sight at most this long (a decider that never answers)
Pin = Callable[[ev.Key, list[int]], list[int]]  # (key, ranks) → the fds holding their slots pinned
Steps = dict[int, dict[int, dict[str, Any]]]  # rank → {step: snapshot header}
Outcome = tuple[str, int, Any]  # ("committed", step, manifest) | ("given-up", step, why) | ("failed", step, err)


class Reporter:
    """One keeper's reports. ``coordinator()``: this is rank 0's node."""

    def __init__(self, link: DeciderLink, coordinator: Callable[[], bool], pin: Pin | None = None) -> None:
        self.link, self.node, self.is_coordinator = link, link.node, coordinator
        self.pin = pin  # pins a step due for persistence on sight (``pin_on_sight``), None: reports only
        self.sight: dict[ev.Key, tuple[list[int], float]] = {}  # key → (fds, since): pinned on sight
        self.sighted: set[ev.Key] = set()  # keys pinned on sight (or tried), still held
        self.incarnation = time.time_ns() // 1_000_000  # a restarted keeper on this node reports higher
        self.seq = 0
        self.held: ev.Held | None = None  # as last reported
        self.current: ev.Held = ()  # as last seen
        self.due_held: set[ev.Key] = set()  # the keys flagged for persistence among them
        self.pins_held: set[ev.Key] = set()  # ... and those pinned on sight
        self.sent_at = -float("inf")
        self.due_sent: set[ev.Key] = set()
        self.commits: dict[int, ev.Commit] = {}  # the committer: commits to do
        self.gone: set[int] = set()  # epochs whose WorkersGone was sent
        self.settled: set[int] = set()  # steps the decider planned or gave up (held ones only)

    def observe(self, steps: Steps, flagged: list[int], copies: Steps | None = None) -> None:
        """The node's snapshots and the steps due: report what changed. The decider plans a due step from
        holdings, so they go at once when the flagged steps among them change (one comes, or goes: moved
        past), else at most every ``HOLDING_EVERY_S`` — not at every step of every node."""
        own = holdings(steps)
        due = {(s, e) for s, e, _, _ in own if any(by_step.get(s, {}).get("persist") for by_step in steps.values())}
        # Once every rank of the node published it (the node's pin says so for all of them), and only
        # once: a step released is not pinned again while it is still in memory.
        fresh = {(s, e) for s, e, ranks, _ in own if (s, e) in due and len(ranks) == len(steps)} - self.sighted
        if fresh and self.pin is not None and not self.sight:  # one at a time: the slots stay usable
            key = max(fresh)
            self.sighted.add(key)
            if fds := self.pin(key, list(steps)):
                self.sight[key] = (fds, time.monotonic())
        held = self.current = holdings(steps, set(self.sight), copies)
        self.sighted &= {(s, e) for s, e, _, _ in held}
        now = time.monotonic()
        news = due != self.due_held or set(self.sight) != self.pins_held  # a step due or a pin: at once
        if (held != self.held and (news or now - self.sent_at >= HOLDING_EVERY_S)) or self.link.missed:
            self.link.missed = False
            self.held, self.due_held, self.sent_at, self.seq = held, due, now, self.seq + 1
            self.pins_held = set(self.sight)
            self.link.send(ev.Holding(self.node, self.incarnation, self.seq, held))
        self.link.eager = bool(self.commits or due)
        if self.is_coordinator():
            for step in flagged:
                key = (step, _epoch(steps, step))
                if key not in self.due_sent:
                    self.due_sent.add(key)
                    self.link.send(ev.PersistDue(*key))

    def _prune(self) -> None:
        """Keep the bookkeeping of held steps only: a job's life long, it stays small."""
        held = {(s, e) for s, e, _, _ in self.current}
        self.due_sent &= held
        oldest = min((s for s, _ in held), default=0)
        self.settled = {s for s in self.settled if s >= oldest}

    def _settle(self, d: ev.Persist | ev.Commit | ev.GiveUp) -> None:
        """The decider planned, committed or gave up a step: its due step is heard."""
        self.settled.add(d.key[0] if isinstance(d, ev.Persist) else d.step)

    def rolled_back(self, epoch: int, latest: int) -> None:
        """Storage moved back to ``latest``: the redone steps (same numbers) are new to the decider."""
        self.due_sent = {k for k in self.due_sent if k[0] <= latest}
        self.sighted = {k for k in self.sighted if k[0] <= latest}
        self.settled = {s for s in self.settled if s <= latest}
        self.link.send(ev.RolledBack(epoch, latest))

    def _unpin(self, key: ev.Key) -> None:
        for fd in self.sight.pop(key)[0]:
            os.close(fd)

    def workers_died(self, job: NodeJob, world: int, owners: dict[int, dict[str, Any] | None], died: set[int]) -> None:
        """All this node's workers gone, one of them died (``died``: pids; a closed one did not): its final holdings."""
        pids = [int(o["pid"]) for o in owners.values() if o]
        # The dead workers' execution, from their records: job.json may already be the next execution's
        # (its workers start while these records are still in place), whose failure this is not.
        epoch = max((int(o.get("epoch", job.epoch())) for o in owners.values() if o), default=job.epoch())
        if epoch in self.gone or not any(p in died for p in pids) or any(pid_alive(p) for p in pids):
            return
        self.gone.add(epoch)
        final = holdings(job.snapshot_steps(world, list(owners)), copies=job.copy_steps(world))
        self.link.send(ev.WorkersGone(self.node, epoch, final))

    def end(self, job_complete: bool, wait_s: float = 2.0) -> None:
        """The keeper exits: a bounded last exchange (decisions only heard) until every due step is planned or
        given up, so the final commit reaches the decider; then, from rank 0's node of a finished job, its end."""
        deadline = time.monotonic() + wait_s
        while self.link.formed and self.link.sync(max(0.0, deadline - time.monotonic())):
            for d in self.link.take():
                log.info("decider (keeper exiting): %r", d)
                if isinstance(d, ev.Persist | ev.Commit | ev.GiveUp):
                    self._settle(d)
            unheard = [s for s, _ in self.due_held if s not in self.settled]  # its plan may be on its way
            if not (self.commits or self.link.pending() or unheard):
                break
            time.sleep(0.05)
        for key in list(self.sight):
            self._unpin(key)
        if job_complete and self.is_coordinator() and self.link.formed:
            self.link.send(ev.JobEnded())
            self.link.sync(max(0.5, deadline - time.monotonic()))
        self.link.close()


def holdings(steps: Steps, pinned: set[ev.Key] = frozenset(), copies: Steps | None = None) -> ev.Held:
    """rank → {step: header} as the decider's ``Held``: (step, epoch, ranks, pinned) in a stable order;
    ``copies``: the peer copies held of other nodes' ranks, which the decider counts as held too."""
    keys: dict[ev.Key, set[int]] = {}
    for by_rank in (steps, copies or {}):
        for rank, by_step in by_rank.items():
            for step, header in by_step.items():
                keys.setdefault((step, epoch_of(header)), set()).add(rank)
    return tuple((s, e, tuple(sorted(r)), (s, e) in pinned) for (s, e), r in sorted(keys.items()))


def pin_on_sight(paths: JobPaths, key: ev.Key, ranks: list[int]) -> list[int]:
    """Pin every one of ``ranks``' snapshots of ``key`` (the fds), or none when one is gone or busy: a
    step due for persistence is held until the decider's word, however fast the workers move on."""
    fds: list[int] = []
    try:
        for r in ranks:
            info = next(i for i in complete_slots(paths, r) if (i.step, epoch_of(i.header)) == key)
            fds.append(pin_slot(paths, info)[0])
    except (StopIteration, OSError):  # overwritten meanwhile: the decider hears the holdings as they are
        for fd in fds:
            os.close(fd)
        return []
    return fds


def _epoch(steps: dict[int, dict[int, dict[str, Any]]], step: int) -> int:
    return max(epoch_of(by_step[step]) for by_step in steps.values() if step in by_step)


class Actor(Reporter):
    """One keeper's side of the decider's plans (``paths``: the node's job directory)."""

    def __init__(self, link: DeciderLink, paths: JobPaths, coordinator: Callable[[], bool], pin: Any = None) -> None:
        super().__init__(link, coordinator, pin)
        self.paths = paths
        self.acted: tuple[int, int] = (0, 0)  # the newest (plan, attempt) taken up
        self.plan: ev.Persist | None = None  # the plan this node holds pinned, until its end
        self.views: dict[int, SnapshotView] = {}
        self.write: ev.Write | None = None
        self.timed_at = time.monotonic()  # the last step due by time (``persist_every_s``)

    @classmethod
    def of_members(cls, members: Membership, paths: JobPaths, coordinator: Callable[[], bool]) -> Actor:
        link = DeciderLink(members.address, members.token, members.me)
        return cls(link, paths, coordinator, lambda key, ranks: pin_on_sight(paths, key, ranks))

    def due_by_time(self, common: set[int], every_s: float, last: int) -> int | None:
        """Rank 0's node under ``persist_every_s``: the newest step its ranks hold, once that long passed since
        the last (one that other nodes' workers moved past meanwhile is given up; the next interval tries again)."""
        now, newest = time.monotonic(), max(common, default=-1)
        if every_s <= 0 or now - self.timed_at < every_s or newest <= last:
            return None
        self.timed_at = now
        return newest

    def busy(self) -> bool:
        return self.plan is not None or bool(self.commits)

    def act(self, storage: Storage, world: int, source: str = "keeper") -> list[Outcome]:
        """Read the decisions and do this node's part of them; what ended, for the keeper to record."""
        out: list[Outcome] = []
        for d in self.link.take():
            log.info("decider: %r", d)
            if isinstance(d, ev.Persist | ev.Commit | ev.GiveUp):
                self._settle(d)
            if isinstance(d, ev.Release) and d.node in (None, self.node):
                for key in [k for k in self.sight if d.key in (None, k)]:
                    self._unpin(key)
                if self.plan is not None and d.key in (None, self.plan.key) and d.upto >= self.plan.plan:
                    step = self.plan.key[0]
                    self._drop()
                    if (manifest := storage.manifest(step)) is not None:  # (the keeper takes a step once)
                        out.append(("committed", step, manifest))
            elif isinstance(d, ev.Persist) and self.node in d.nodes and (d.plan, d.attempt) > self.acted:
                self._take(d, storage)
            elif isinstance(d, ev.Write) and self.plan is not None and (d.plan, d.attempt) == self.acted:
                self.write = d
            elif isinstance(d, ev.Commit) and self.plan is not None and d.plan == self.plan.plan and self._commits():
                self.commits[d.plan] = d
            elif isinstance(d, ev.GiveUp):
                if self.plan is not None and d.plan == self.plan.plan:
                    if self._commits():  # the node writing rank 0 tidies what the plan left
                        self._tidy(storage, d.step, d.plan)
                    self._drop()
                self.commits.pop(d.plan or -1, None)
                out.append(("given-up", d.step, d.why))
        self.link.eager = self.link.eager or self.busy()
        now = time.monotonic()
        for key, (_, since) in list(self.sight.items()):  # a decider that never answers: bounded
            if now - since > SIGHT_MAX_S and (self.plan is None or key != self.plan.key):
                self._unpin(key)
        if self.write is not None and (failed := self._write(storage, world)) is not None:
            out.append(failed)  # the keeper's storage health counts it (the workers' at-risk bound)
        for plan, c in list(self.commits.items()):
            del self.commits[plan]
            label = "save-on-failure" if self.plan is not None and self.plan.failure else source
            try:
                manifest = plan_write.commit_plan(storage, c.step, plan, self.acted[1], world, label)
            except Exception as err:  # the decider retries (a new attempt) or gives up
                self.link.send(ev.Committed(plan, False, repr(err)))
                out.append(("failed", c.step, err))
                continue
            self.link.send(ev.Committed(plan, True))
            out.append(("committed", c.step, manifest))
        self._prune()
        return out

    def _commits(self) -> bool:
        """The node writing rank 0 commits (a lost rank 0's node: the survivor writing its copy)."""
        return self.plan is not None and ev.committer(dict(self.plan.writers)) == self.node

    def _take(self, p: ev.Persist, storage: Storage) -> None:
        self.acted, self.write = (p.plan, p.attempt), None
        if self.plan is not None and self.plan.plan != p.plan:
            self._drop()  # a newer plan: the decider ended the last one
        ranks = dict(p.writers).get(self.node, ())
        try:
            if self.plan is None:
                for r in ranks:  # one by one: those opened before a failure are closed by _drop
                    self.views[r] = open_view(self.paths, r, p.key)
            self.plan = p
            plan_write.put_tables(storage, p.key[0], p.plan, self.views)
        except Exception as err:  # gone, busy too long, or storage: the decider tries an older step
            self._drop()
            self.link.send(ev.Pinned(self.node, p.plan, False, f"{type(err).__name__}: {err}", p.attempt))
            return
        self.link.send(ev.Pinned(self.node, p.plan, True, attempt=p.attempt))

    def _write(self, storage: Storage, world: int) -> Outcome | None:
        w, self.write = self.write, None
        try:
            plan_write.write_share(storage, w.key[0], w.plan, w.attempt, world, self.views)
        except Exception as err:  # the decider retries (a new attempt) or gives up
            self.link.send(ev.Wrote(self.node, w.plan, w.attempt, False, repr(err)))
            return ("failed", w.key[0], err)
        self.link.send(ev.Wrote(self.node, w.plan, w.attempt, True))
        return None

    @staticmethod
    def _tidy(storage: Storage, step: int, plan: int) -> None:
        try:
            plan_write.remove_plan(storage, step, plan)
        except Exception as err:  # storage down: the next keeper start removes the uncommitted step
            log.warning("could not remove given-up plan %d of step %d: %r", plan, step, err)

    def _drop(self) -> None:
        for v in self.views.values():
            v.close()
        self.views, self.plan, self.write = {}, None, None

    def end(self, job_complete: bool, wait_s: float = 2.0) -> None:
        """The keeper exits: its plan's pins go with it (the decider gives the plan up when the node goes)."""
        self._drop()
        self.commits.clear()
        super().end(job_complete, wait_s)


def reporter(members: Membership | None, paths: JobPaths, coordinator: Callable[[], bool]) -> Actor | None:
    """The keeper's line to the decider (``members``: where it is), None until that is known."""
    return None if members is None else Actor.of_members(members, paths, coordinator)


def open_view(paths: JobPaths, rank: int, key: ev.Key) -> SnapshotView:
    """``rank``'s snapshot ``key`` opened pinned: this node's own, or a peer copy it holds."""
    roots = host_roots(paths)
    return open_pinned(roots, rank, lambda i: (i.step, epoch_of(i.header)) == key, f"step {key[0]} of epoch {key[1]}")


def await_restart(
    members: Membership,
    epoch: int,
    storage: Callable[[], Storage | None],
    commit: bool,
    timeout_s: float = 60.0,
    after: int | None = None,
) -> dict[str, Any]:
    """The agent's side of a failure: wait for the decider's ``RestartMayProceed`` of execution ``epoch`` and,
    with ``commit`` (a new world restores from storage, or a preemption ends the job), for its commit. ``after``:
    ``decisions_mark`` at the agent's start: a word before this call counts, an earlier launch's does not."""
    link = DeciderLink(members.address, members.token, members.me)
    link.after, link.eager = (after if after is not None else 0), True
    deadline = time.monotonic() + timeout_s
    try:
        link.send()
        word: ev.RestartMayProceed | None = None
        while word is None and time.monotonic() < deadline:
            said = [d for d in link.take() if isinstance(d, ev.RestartMayProceed) and d.failed_epoch == epoch]
            word = said[0] if said else None
            time.sleep(0.02)
    finally:
        link.close()
    if word is None:
        return {"persisted": None, "detail": f"no word from the decider within {timeout_s:g} s: restarting"}
    if word.key is None:
        return {"persisted": False, "detail": f"the decider saves nothing: {word.why}"}
    step = word.key[0]
    if not commit:
        return {"persisted": None, "step": step, "detail": f"every node holds step {step} pinned ({word.why})"}
    while time.monotonic() < deadline:
        if (store := storage()) is not None:
            store.refresh()
            if (store.latest() or -1) >= step:
                return {"persisted": True, "step": step, "detail": f"the decider's save committed step {step}"}
        time.sleep(0.05)
    return {"persisted": False, "step": step, "detail": f"step {step} not committed within {timeout_s:g} s"}

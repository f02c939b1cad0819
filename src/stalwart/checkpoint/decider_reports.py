"""A keeper's reports to the checkpoint decider: what its node holds, which steps are due, its workers'
end and the job's end — the half of :class:`~.decider_actor.Actor` that tells; the actor does.

Each keeper reports its node's snapshots (``Holding``, at once when the steps flagged for persistence
among them change, else at most once a second), the steps due (``PersistDue``, by rank 0's node), its
workers' end (``WorkersGone``, their final holdings) and, from rank 0's node, the job's end
(``JobEnded``). A step due for persistence is pinned on sight (``pin_on_sight``) until the decider's
``Release``: the workers may move past it before the decider's ``Persist`` arrives.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider_link import DeciderLink
from stalwart.checkpoint.node_job import NodeJob
from stalwart.checkpoint.shm import JobPaths, complete_slots, pid_alive, pin_slot
from stalwart.checkpoint.snapshot import epoch_of

log = logging.getLogger("stalwart.checkpoint.keeper")
HOLDING_EVERY_S = 1.0  # holdings that change no step due are reported at most this often
SIGHT_MAX_S = 10.0  # a pin on sight at most this long (a decider that never answers)
Pin = Callable[[ev.Key, list[int]], list[int]]  # (key, ranks) → the fds holding their slots pinned
Steps = dict[int, dict[int, dict[str, Any]]]  # rank → {step: snapshot header}


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
        """The node's snapshots (rank → {step: header}) and the steps due: report what changed. The
        decider plans a due step from holdings, so they are sent at once when the steps flagged for
        persistence among them change (one comes, or goes: moved past), else at most every
        ``HOLDING_EVERY_S`` — not at every step of every node."""
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
        """Once every worker of this node is gone and one at least died (``died``: their pids; a closed
        one did not), its final holdings for the execution they ran."""
        pids = [int(o["pid"]) for o in owners.values() if o]
        epoch = job.epoch()
        if epoch in self.gone or not any(p in died for p in pids) or any(pid_alive(p) for p in pids):
            return
        self.gone.add(epoch)
        final = holdings(job.snapshot_steps(world, list(owners)), copies=job.copy_steps(world))
        self.link.send(ev.WorkersGone(self.node, epoch, final))

    def end(self, job_complete: bool, wait_s: float = 2.0) -> None:
        """The keeper exits: a bounded last exchange, until every step due among its snapshots has been
        planned or given up, so the final commit reaches the decider; then, from rank 0's node when the
        job completed, its end. Nothing is taken up any more, only heard."""
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

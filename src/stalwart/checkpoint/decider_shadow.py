"""Shadow reports: the keeper tells the decider what it holds and what storage got, without acting on it.

Step 2 of docs/protocol.md's plan: the `.stage/` protocol (``multinode``, ``stage``) still persists;
each keeper also reports its node's snapshots (``Holding``, on a change only), the steps due
(``PersistDue``, by rank 0's node), its workers' end (``WorkersGone``) and the job's end (``JobEnded``),
and answers the decider's plans from what the old protocol did: a plan's step committed in storage is
``Pinned`` and ``Wrote`` (and ``Committed`` by rank 0's node), one it can no longer hold or that the
old protocol gave up is refused (``Pinned`` not ok). The decider's decisions land in the master's
journal and the keeper's log, so a real run shows whether the decider names the steps the old
protocol committed (the e2e tests check) before anything depends on it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider_link import DeciderLink
from stalwart.checkpoint.membership import LostNodes
from stalwart.checkpoint.node_job import NodeJob
from stalwart.checkpoint.shm import JobPaths, complete_slots, pid_alive, pin_slot
from stalwart.checkpoint.snapshot import epoch_of

log = logging.getLogger("stalwart.checkpoint.keeper")
CHECK_EVERY_S = 0.2  # how often a pending plan's step is looked up in storage
HOLDING_EVERY_S = 1.0  # holdings that change no step due are reported at most this often
SIGHT_KEEP_S = 1.0  # a pin on sight of a step the old protocol is done with waits this long for the decider
SIGHT_MAX_S = 10.0  # ... and any pin on sight at most this long (a decider that never answers)
Pin = Callable[[ev.Key, list[int]], list[int]]  # (key, ranks) → the fds holding their slots pinned
Steps = dict[int, dict[int, dict[str, Any]]]  # rank → {step: snapshot header}


class Shadow:
    """One keeper's reports. ``coordinator()``: this is rank 0's node; ``committed(step)``: storage
    holds that step committed."""

    def __init__(
        self,
        link: DeciderLink,
        coordinator: Callable[[], bool],
        committed: Callable[[int], bool],
        pin: Pin | None = None,
    ) -> None:
        self.link, self.node, self.is_coordinator, self._committed = link, link.node, coordinator, committed
        self.pin = pin  # pins a step due for persistence on sight (``pin_on_sight``), None: reports only
        self.sight: dict[ev.Key, tuple[list[int], float]] = {}  # key → (fds, since): pinned on sight
        self.sighted: set[ev.Key] = set()  # keys pinned on sight (or tried), still held
        self.seen_committed: set[int] = set()  # retention may remove a step later: its word stands
        self.incarnation = time.time_ns() // 1_000_000  # a restarted keeper on this node reports higher
        self.seq = 0
        self.held: ev.Held | None = None  # as last reported
        self.current: ev.Held = ()  # as last seen
        self.due_held: set[ev.Key] = set()  # the keys flagged for persistence among them
        self.pins_held: set[ev.Key] = set()  # ... and those pinned on sight
        self.sent_at = -float("inf")
        self.due_sent: set[ev.Key] = set()
        self.plans: dict[int, ev.Persist] = {}  # plans naming this node, not yet answered in full
        self.commits: dict[int, ev.Commit] = {}  # rank 0's node: commits to confirm
        self.answered: set[tuple[str, int, int]] = set()  # (what, plan, attempt) sent
        self.awaiting: set[int] = set()  # rank 0's node: plans written everywhere here, their commit to come
        self.gone: set[int] = set()  # epochs whose WorkersGone was sent
        self.settled: set[int] = set()  # steps the decider planned or gave up (held ones only)
        self._checked = 0.0

    @classmethod
    def of(
        cls,
        members: LostNodes | None,
        coordinator: Callable[[], bool],
        committed: Callable[[int], bool],
        paths: JobPaths,
    ) -> Shadow | None:
        """Under ``stalwart run`` (the keeper knows the master: ``members``); else None."""
        if members is None:
            return None
        link = DeciderLink(members.address, members.token, members.me)
        return cls(link, coordinator, committed, lambda key, ranks: pin_on_sight(paths, key, ranks))

    def committed(self, step: int) -> bool:
        if step not in self.seen_committed and self._committed(step):
            self.seen_committed.add(step)
        return step in self.seen_committed

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
        self.link.eager = bool(self.plans or self.commits or self.awaiting or due)
        if self.is_coordinator():
            for step in flagged:
                key = (step, _epoch(steps, step))
                if key not in self.due_sent:
                    self.due_sent.add(key)
                    self.link.send(ev.PersistDue(*key))

    def answer(self, last_persisted: int, given_up: set[int], final: bool = False) -> None:
        """Read the decider's decisions and answer the plans from what the old protocol did."""
        for d in self.link.take():
            log.info("decider (shadow): %r", d)
            if isinstance(d, ev.Release) and d.node in (None, self.node):
                for key in [k for k in self.sight if d.key in (None, k)]:
                    self._unpin(key)
            if isinstance(d, ev.Persist) and self.node in d.nodes:
                self.plans[d.plan] = d
            elif isinstance(d, ev.Commit) and self.is_coordinator():
                self.commits[d.plan] = d
            elif isinstance(d, ev.GiveUp):
                self.settled.add(d.step)
                self.plans.pop(d.plan, None)
                self.commits.pop(d.plan, None)
                self.awaiting.discard(d.plan)
            if isinstance(d, ev.Persist | ev.Commit):
                self._settle(d)
        now = time.monotonic()
        for key, (_, since) in list(self.sight.items()):  # the decider is slow or gone: bounded
            done = key[0] <= last_persisted or key[0] in given_up or final
            if now - since > (SIGHT_KEEP_S if done else SIGHT_MAX_S):
                self._unpin(key)
        if not (self.plans or self.commits) or now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        for plan in list(self.plans.values()):
            self._answer_plan(plan, last_persisted, given_up, final)
        for c in list(self.commits.values()):
            if self.committed(c.step):
                self.link.send(ev.Committed(c.plan, True))
                del self.commits[c.plan]
                self.awaiting.discard(c.plan)
        self._prune()

    def _prune(self) -> None:
        """Keep the bookkeeping of open plans and held steps only: a job's life long, it stays small."""
        open_plans = {*self.plans, *self.commits, *self.awaiting}
        self.answered = {m for m in self.answered if m[1] in open_plans}
        held = {(s, e) for s, e, _, _ in self.current}
        self.due_sent &= held
        oldest = min((s for s, _ in held), default=0)
        self.seen_committed = {s for s in self.seen_committed if s >= oldest}
        self.settled = {s for s in self.settled if s >= oldest}

    def _answer_plan(self, p: ev.Persist, last_persisted: int, given_up: set[int], final: bool) -> None:
        step = p.key[0]
        if self.committed(step):
            self._once("pinned", p, ev.Pinned(self.node, p.plan, True, attempt=p.attempt))
            self._once("wrote", p, ev.Wrote(self.node, p.plan, p.attempt, True))
            del self.plans[p.plan]
            if self.is_coordinator():
                self.awaiting.add(p.plan)
        elif final or step in given_up or last_persisted > step or not self._holds(p.key):
            why = "given up by the old protocol" if step in given_up else "not persisted by the old protocol"
            self._once("refused", p, ev.Pinned(self.node, p.plan, False, why))  # even after a pin said ok
            del self.plans[p.plan]
        else:
            # the old protocol may be writing it
            self._once("pinned", p, ev.Pinned(self.node, p.plan, True, attempt=p.attempt))

    def _settle(self, d: ev.Persist | ev.Commit | ev.GiveUp) -> None:
        """The decider planned, committed or gave up a step: its due step is heard."""
        self.settled.add(d.key[0] if isinstance(d, ev.Persist) else d.step)

    def rolled_back(self, epoch: int, latest: int) -> None:
        """Storage moved back to ``latest``: the redone steps (same numbers) are new to the decider."""
        self.seen_committed = {s for s in self.seen_committed if s <= latest}
        self.due_sent = {k for k in self.due_sent if k[0] <= latest}
        self.sighted = {k for k in self.sighted if k[0] <= latest}
        self.settled = {s for s in self.settled if s <= latest}
        self.link.send(ev.RolledBack(epoch, latest))

    def _unpin(self, key: ev.Key) -> None:
        for fd in self.sight.pop(key)[0]:
            os.close(fd)

    def _once(self, what: str, p: ev.Persist, event: Any) -> None:
        mark = (what, p.plan, p.attempt if what in ("wrote", "pinned") else 0)
        if mark not in self.answered:
            self.answered.add(mark)
            self.link.send(event)

    def _holds(self, key: ev.Key) -> bool:
        return any(s == key[0] and e == key[1] for s, e, _, _ in self.current)

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

    def end(self, job_complete: bool, last_persisted: int, given_up: set[int], wait_s: float = 2.0) -> None:
        """The keeper exits, the old protocol done: a bounded last exchange of answers (a plan whose step
        storage lacks is refused now), so the final commit reaches the decider; then, from rank 0's node
        when the job completed, its end."""
        deadline = time.monotonic() + wait_s
        while self.link.formed and self.link.sync(max(0.0, deadline - time.monotonic())):
            self._checked = 0.0
            self.answer(last_persisted, given_up, final=True)
            unheard = [s for s, _ in self.due_held if s not in self.settled]  # its plan may be on its way
            if not (self.plans or self.commits or self.awaiting or self.link.pending() or unheard):
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

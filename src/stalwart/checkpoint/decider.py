"""The one checkpoint decider (docs/protocol.md): which step is persisted, saved on failure or given up.
A pure, deterministic state machine — no I/O, threads or clocks, so ``tests/protocol`` can explore it:
``handle(event)`` returns its decisions. Every wait ends on an event (membership included), never a timer;
a message of an earlier epoch or an old plan is ignored and logged. State: ``decider_wire.to_state``.
"""

from __future__ import annotations

from typing import Any

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider_events import Decision, Event, Key, committer

MAX_ATTEMPTS = 3  # a plan's writes or commit retried this often (storage failing, a keeper restarted)


class Decider:
    def __init__(self, nodes: dict[str, list[int]], epoch: int = 0, max_attempts: int = MAX_ATTEMPTS) -> None:
        self.epoch = epoch
        self.nodes: dict[str, list[int]] = {n: sorted(r) for n, r in nodes.items()}
        self.world: list[int] = sorted(r for rs in self.nodes.values() for r in rs)
        self.max_attempts = max_attempts
        self.held: dict[str, dict[Key, list[int]]] = {n: {} for n in self.nodes}  # node → key → ranks
        self.pins: dict[str, list[Key]] = {n: [] for n in self.nodes}  # what each node reports pinned
        self.seen: dict[str, tuple[int, int]] = {}  # node → newest (incarnation, seq) heard
        self.plan: dict[str, Any] | None = None  # the one persist in flight
        self.next_plan = 1
        self.due: int | None = None  # newest step due in this epoch, not yet planned
        self.passed = -1  # newest step due in this epoch dropped unplanned (moved past, coalesced)
        self.latest: int | None = None  # the newest committed step
        self.failure: dict[str, Any] | None = None  # the failed execution's save, until restart may proceed
        self.lost: list[str] = []  # nodes lost in this epoch (membership)
        self.settled = -1  # the newest epoch whose failure was settled: later word of it is late
        self.ended = False
        self.log: list[str] = []

    def idle(self) -> bool:
        """Nothing in flight or pending: a job may end without losing a decided persist."""
        return self.plan is None and self.due is None and (self.failure is None or bool(self.failure.get("done")))

    def common(self, held: dict[str, dict[Key, list[int]]], below: Key | None = None) -> Key | None:
        """The newest key every rank of the world holds (older than ``below``), or None."""
        by_key: dict[Key, set[int]] = {}
        for h in held.values():  # a rank may be held twice: by its node and as a peer's copy
            for key, ranks in h.items():
                by_key.setdefault(key, set()).update(ranks)
        full = [k for k, rs in by_key.items() if rs.issuperset(self.world) and (below is None or k < below)]
        return max(full) if full else None

    def handle(self, event: Event) -> list[Decision]:
        out: list[Decision] = []
        if self.ended and not isinstance(event, ev.Holding):
            self._note(f"ignored {type(event).__name__}: the job ended")
            return out
        method = getattr(self, "_on_" + type(event).__name__)
        method(event, out)
        if not self.ended:
            self._release_unwanted(out)
        return out

    def _release_unwanted(self, out: list[Decision]) -> None:
        """Pins reported that nobody needs any more (a due step superseded or given up, an earlier
        epoch's, a release lost with a keeper): one ``Release`` each, until a report shows it again."""
        for node, keys in self.pins.items():
            for key in [k for k in keys if not self._wanted(node, k)]:
                keys.remove(key)
                out.append(ev.Release(node, key, self.next_plan - 1, self.epoch))

    def _note(self, line: str) -> None:
        self.log.append(f"[epoch {self.epoch}] {line}")

    def _late(self, what: str, epoch: int) -> bool:
        """An event of an earlier epoch is late and ignored. One of a later epoch cannot come first: the
        decider lives where membership is decided, so it hears ``EpochBegan`` before any node can."""
        if epoch < self.epoch:
            self._note(f"ignored late {what} from epoch {epoch}")
            return True
        assert epoch == self.epoch, f"{what} from epoch {epoch} before that epoch began (now {self.epoch})"
        return False

    def _on_Holding(self, e: ev.Holding, out: list[Decision]) -> None:
        mark = (e.incarnation, e.seq)
        if e.node not in self.nodes or e.node in self.lost or mark <= self.seen.get(e.node, (-1, -1)):
            self._note(f"ignored a stale, unknown or lost node's report: {e.node} {mark}")
            return
        restarted = e.node in self.seen and e.incarnation > self.seen[e.node][0]
        self.seen[e.node] = mark
        self.held[e.node] = {(s, ep): list(r) for s, ep, r, _ in e.held}
        self.pins[e.node] = [(s, ep) for s, ep, _, pinned in e.held if pinned]
        if self.ended:
            if e.held:
                out.append(ev.Release(e.node, None, self.next_plan, self.epoch, free=True))
            return
        if restarted and self._lost_with_keeper(e.node):
            self._retry(f"node {e.node}'s keeper restarted", out)
        self._advance(out)

    def _lost_with_keeper(self, node: str) -> bool:
        """A keeper of the plan restarted: its pins died with it (and the commit, were it the committer)."""
        p = self.plan
        return p is not None and node in p["nodes"] and (node not in p["wrote"] or node == self._committing())

    def _committing(self) -> str | None:
        """The node committing the plan now, if it is."""
        return committer(self.plan["writers"]) if self.plan is not None and self.plan["committing"] else None

    def _wanted(self, node: str, key: Key) -> bool:
        """A pin the decider may still ask for: its plan's, or a step of this epoch that may yet be
        planned — keepers pin a step flagged for persistence on sight, so that the workers moving on
        before the ``Persist`` comes back cannot take it away (a save-on-failure chooses among all)."""
        plan = self.plan
        if plan is not None and tuple(plan["key"]) == key:
            return node in plan["nodes"]
        if key[1] != self.epoch or (self.latest is not None and key[0] <= self.latest):
            return False
        if self.failure is not None:
            return not self.failure.get("done")
        planned = plan["key"][0] if plan is not None and plan["key"][1] == self.epoch else -1
        return key[0] > max(planned, self.passed) and key[0] >= (self.due if self.due is not None else -1)

    def _on_PersistDue(self, e: ev.PersistDue, out: list[Decision]) -> None:
        if self._late("persist due", e.epoch) or self.failure is not None or e.epoch <= self.settled:
            return  # the execution failed: its save-on-failure decides
        planned = self.plan["key"][0] if self.plan is not None and self.plan["key"][1] == self.epoch else None
        if (self.latest is None or e.step > self.latest) and e.step > max(self.due or -1, planned or -1):
            if self.due is not None:
                self._note(f"coalesced: step {self.due} superseded by step {e.step}")
                self.passed = self.due
            self.due = e.step
        self._advance(out)

    def _on_Pinned(self, e: ev.Pinned, out: list[Decision]) -> None:
        if (plan := self._current(e.plan, e.node)) is None:
            return
        if not e.ok:  # whatever the attempt: a snapshot once gone never comes back
            self._end_plan(f"node {e.node} does not hold {tuple(plan['key'])}: {e.reason}", out)
            return
        if e.attempt != plan["attempt"]:
            self._note(f"ignored node {e.node}'s pin of attempt {e.attempt} of plan {e.plan} (now {plan['attempt']})")
            return
        self._pinned(plan, e.node, out)

    def _pinned(self, plan: dict[str, Any], node: str, out: list[Decision], wrote: bool = False) -> None:
        if node not in plan["pinned"]:
            plan["pinned"].append(node)
        if len(plan["pinned"]) < len(plan["nodes"]):
            return
        if not wrote and plan.get("write_sent") != plan["attempt"]:  # every entry table is beside the step
            plan["write_sent"] = plan["attempt"]
            out.append(ev.Write(plan["id"], tuple(plan["key"]), plan["attempt"], self.epoch))
        f = self._failure_of(plan)
        if f is not None and not f["released"]:
            self._release_restart(tuple(plan["key"]), "every node holds it pinned", out)

    def _failure_of(self, plan: dict[str, Any]) -> dict[str, Any] | None:
        """The open failure this plan saves for, if it is that save."""
        f = self.failure
        return f if f is not None and plan["failure"] is not None and plan["failure"] == f["epoch"] else None

    def _on_Wrote(self, e: ev.Wrote, out: list[Decision]) -> None:
        if (plan := self._current(e.plan, e.node)) is None:
            return
        if e.attempt != plan["attempt"]:
            self._note(f"ignored node {e.node}'s word on attempt {e.attempt} of plan {e.plan} (now {plan['attempt']})")
            return
        if not e.ok:
            self._retry(f"node {e.node} failed writing: {e.reason}", out)
            return
        self._pinned(plan, e.node, out, wrote=True)  # its Pinned may still be on its way
        if e.node not in plan["wrote"]:
            plan["wrote"].append(e.node)
        if len(plan["wrote"]) == len(plan["nodes"]) and not plan["committing"]:
            plan["committing"] = True
            out.append(ev.Commit(plan["id"], plan["key"][0], self.epoch))

    def _on_Committed(self, e: ev.Committed, out: list[Decision]) -> None:
        if (plan := self._current(e.plan, None)) is None:
            return
        if not e.ok:
            plan["committing"] = False
            self._retry(f"commit failed: {e.reason}", out)
            return
        self.latest = plan["key"][0]
        self._note(f"committed step {self.latest} (plan {plan['id']})")
        self._finish(out)

    def _on_WorkersGone(self, e: ev.WorkersGone, out: list[Decision]) -> None:
        if self._late(f"workers-gone of node {e.node}", e.epoch) or e.node not in self.nodes or e.node in self.lost:
            return  # (a lost node's word still on its way: its memory is gone)
        if self._open_failure(e.epoch, out):
            self.failure["final"][e.node] = {(s, ep): list(r) for s, ep, r, _ in e.held}
            self._advance(out)

    def _on_NodeLost(self, e: ev.NodeLost, out: list[Decision]) -> None:
        if self._late(f"loss of node {e.node}", e.epoch) or e.node not in self.nodes:
            return
        self._note(f"node {e.node} lost")
        if self._open_failure(e.epoch, out):
            self.failure["final"][e.node] = {}  # its memory is gone with it
        self.held[e.node], self.pins[e.node] = {}, []
        self.lost.append(e.node)
        if self.plan and e.node in self.plan["nodes"]:
            self._lost_in_plan(e.node, out)
        self._advance(out)

    def _lost_in_plan(self, node: str, out: list[Decision]) -> None:
        """A participant is gone: its shards will never come, or its commit. Given up at once (no timeout)."""
        if self.plan["committing"] and node != self._committing():
            return  # every shard is written; the commit is the committer's alone
        self._end_plan(f"node {node} lost during the persist", out)

    def _on_Preempted(self, e: ev.Preempted, out: list[Decision]) -> None:
        if self._late("preemption notice", e.epoch):
            return
        if self._open_failure(e.epoch, out):  # else this execution's save is already settled
            self.failure["preempted"] = True

    def _on_EpochBegan(self, e: ev.EpochBegan, out: list[Decision]) -> None:
        if e.epoch <= self.epoch:
            self._note(f"ignored late start of epoch {e.epoch}")
            return
        if self.failure is not None:
            if not self.failure["released"] and self.plan and self._failure_of(self.plan) is not None:
                self._end_plan(f"epoch {e.epoch} began before the save was pinned", out)
            if not self.failure.get("preempted"):
                self.failure = None  # a released save goes on in the background, as a plain plan
        self.epoch, self.due, self.passed, self.lost = e.epoch, None, -1, []
        self.nodes = {n: sorted(r) for n, r in e.nodes}
        self.world = sorted(r for rs in self.nodes.values() for r in rs)  # a grown or shrunk job
        self.held = {n: self.held.get(n, {}) for n in self.nodes}
        self.pins = {n: self.pins.get(n, []) for n in self.nodes}
        if self.plan and any(n not in self.nodes for n in self.plan["nodes"]):
            self._lost_in_plan(next(n for n in self.plan["nodes"] if n not in self.nodes), out)
        self._note(f"epoch {e.epoch} began with nodes {sorted(self.nodes)}")

    def _on_RolledBack(self, e: ev.RolledBack, out: list[Decision]) -> None:
        if self._late("rollback", e.epoch) or self.latest is None or self.latest <= e.latest:
            return  # (every node's keeper reports the same rollback)
        self._note(f"rolled back: committed steps after {e.latest} deleted, redone steps persist again")
        self.latest, self.passed = (e.latest if e.latest >= 0 else None), -1
        for h in self.held.values():  # the abandoned future's snapshots: the keepers report anew
            for key in [k for k in h if k[0] > e.latest and k[1] == self.epoch]:
                del h[key]
        if self.plan is not None and self.plan["key"][0] > e.latest and not self.plan["committing"]:
            self._end_plan("a rollback abandoned its step", out)

    def _on_JobEnded(self, e: ev.JobEnded, out: list[Decision]) -> None:
        self.ended = True
        if self.plan is not None:
            self._note(f"job ended: plan {self.plan['id']} (step {self.plan['key'][0]}) given up")
            out.append(ev.GiveUp(self.plan["id"], self.plan["key"][0], "the job ended", self.epoch))
            self.plan = None
        self.due, self.failure = None, None
        out.append(ev.Release(None, None, self.next_plan, self.epoch, free=True))

    def _open_failure(self, epoch: int, out: list[Decision]) -> bool:
        """The failure of ``epoch``, opened now if it is not yet; False: its save is already settled."""
        if self.failure is None and epoch <= self.settled:
            self._note(f"ignored late word of epoch {epoch}'s failure: its save settled")
            return False
        if self.failure is None:
            self._note("the execution failed: collecting every node's final holdings")
            self.failure = {"epoch": self.epoch, "final": {}, "released": False, "preempted": False, "tried": []}
            if self.due is not None:
                out.append(ev.GiveUp(None, self.due, "superseded by the save-on-failure", self.epoch))
                self.due = None  # its pins on sight stay: the save chooses among the final holdings
        return True

    def _failure_ready(self) -> bool:
        """Every node's final holdings are known (its workers gone, or it was lost)."""
        return all(n in self.failure["final"] for n in self.nodes)

    def _save_on_failure(self, out: list[Decision]) -> None:
        f = self.failure
        below = min((tuple(k) for k in f["tried"]), default=None)
        key = self.common(f["final"], below)
        if key is None:
            self._release_restart(None, "no step is held by every rank", out)
            self._close_failure()
        elif self.latest is not None and key[0] <= self.latest:
            self._release_restart(None, f"step {key[0]} is already committed", out)
            self._close_failure()
        else:
            f["tried"].append(list(key))
            self._start(key, f["final"], failure=f["epoch"], out=out)

    def _release_restart(self, key: Key | None, why: str, out: list[Decision]) -> None:
        self.failure["released"] = True
        self._note(f"restart of epoch {self.failure['epoch']} may proceed: {key} ({why})")
        out.append(ev.RestartMayProceed(self.failure["epoch"], key, why))

    def _close_failure(self) -> None:
        self.settled = max(self.settled, self.failure["epoch"])
        self.failure = None if not self.failure["preempted"] else {**self.failure, "done": True}

    def _advance(self, out: list[Decision]) -> None:
        """Start what is due, once nothing is in flight: the save-on-failure first, then a due step."""
        if self.plan is not None:
            return
        f = self.failure
        if f is not None:
            if not f.get("done") and self._failure_ready():
                self._save_on_failure(out)
            return
        if self.due is None:
            return
        key = (self.due, self.epoch)
        if all(self._holds(r, key) for r in self.world):
            self.due = None
            self._start(key, self.held, failure=None, out=out)
        elif (skip := self._moved_past(key)) is not None:  # a keeper that did not see it (restarted)
            out.append(ev.GiveUp(None, key[0], f"rank {skip} moved past it without holding it", self.epoch))
            self.due, self.passed = None, key[0]

    def _holds(self, rank: int, key: Key) -> bool:
        return any(rank in h.get(key, ()) for h in self.held.values())

    def _moved_past(self, key: Key) -> int | None:
        """A rank whose own node holds a newer step of this epoch of it but no node ``key``: it never will.
        (A peer's newer copy says nothing of the rank's own node, whose report may be on its way.)"""
        for node, h in self.held.items():
            for k, ranks in h.items():
                if k[1] == key[1] and k[0] > key[0]:
                    for r in ranks:
                        if r in self.nodes.get(node, ()) and not self._holds(r, key):
                            return r
        return None

    def _start(self, key: Key, held: dict[str, dict[Key, list[int]]], failure: int | None, out: list[Decision]) -> None:
        writers: dict[str, list[int]] = {}
        for r in self.world:  # its own node when that holds it, else the first holding a copy
            holders = [n for n in sorted(held) if r in held[n].get(key, ()) and n not in self.lost]
            writers.setdefault(next((n for n in holders if r in self.nodes.get(n, ())), holders[0]), []).append(r)
        self.plan = {
            "id": self.next_plan,
            "key": list(key),
            "attempt": 1,
            "nodes": sorted(writers),
            "writers": writers,
            "failure": failure,
            "pinned": [],
            "wrote": [],
            "committing": False,
        }
        self.next_plan += 1
        self._note(f"persist step {key[0]} of epoch {key[1]} (plan {self.plan['id']}, failure={failure})")
        out.append(self._persist(self.plan))

    def _persist(self, plan: dict[str, Any]) -> ev.Persist:
        writers = tuple((n, tuple(rs)) for n, rs in sorted(plan["writers"].items()))
        key, nodes, failure = tuple(plan["key"]), tuple(plan["nodes"]), plan["failure"] is not None
        return ev.Persist(plan["id"], key, plan["attempt"], nodes, self.epoch, failure, writers)

    def _current(self, plan_id: int, node: str | None) -> dict[str, Any] | None:
        if self.plan is None or self.plan["id"] != plan_id:
            self._note(f"ignored a late message about plan {plan_id} (from {node or 'the committer'})")
            return None
        return self.plan

    def _retry(self, why: str, out: list[Decision]) -> None:
        plan = self.plan
        lost = [n for n in plan["nodes"] if n in self.lost]
        if lost or plan["attempt"] >= self.max_attempts:
            last = f"attempt {plan['attempt']} of {self.max_attempts}"
            self._end_plan(f"{why}; node {lost[0]} is lost" if lost else f"{why} ({last})", out)
            return
        plan["attempt"] += 1
        plan["wrote"], plan["pinned"], plan["committing"] = [], [], False  # a restarted keeper's pins died with it
        self._note(f"plan {plan['id']} attempt {plan['attempt']}: {why}")
        out.append(self._persist(plan))

    def _end_plan(self, why: str, out: list[Decision]) -> None:
        """Give the plan up, then start what is due (a failed save-on-failure: the next older common step)."""
        plan = self.plan
        self._note(f"gave up step {plan['key'][0]} (plan {plan['id']}): {why}")
        out.append(ev.GiveUp(plan["id"], plan["key"][0], why, self.epoch))
        self._finish(out, committed=False)

    def _finish(self, out: list[Decision], committed: bool = True) -> None:
        plan, self.plan = self.plan, None
        out.append(ev.Release(None, tuple(plan["key"]), plan["id"], self.epoch))
        for keys in self.pins.values():  # released: not again per node
            if tuple(plan["key"]) in keys:
                keys.remove(tuple(plan["key"]))
        f = self._failure_of(plan)
        if f is not None and (committed or f["released"]):  # else: an older step, still before the restart
            if not f["released"]:
                self._release_restart(tuple(plan["key"]), "the save ended", out)
            self._close_failure()
        self._advance(out)

"""The simulated job's storage (the commit the decider orders) and the invariants checked on every
schedule (docs/protocol.md): a committed step is complete and verifies; ``latest`` only moves forward;
save-on-failure restores and commits the newest step every rank held; the job ends (no wait without an
event, see ``explore.py`` for timers); no snapshot is left in memory after the end."""

from __future__ import annotations

from typing import Any

from stalwart.checkpoint import decider_events as ev


class Violation(AssertionError):
    """An invariant failed on this schedule."""


class StorageAndChecks:
    """Mixed into ``sim.World``: the committer and the checks, over the world's fields."""

    ranks: dict[int, Any]
    nodes: dict[str, Any]
    saves: list[dict[str, Any]]
    committed: list[int]

    def excuse(self, current: bool = True) -> None:
        """A fault that may cost a save in flight (a node, a keeper, storage): its save is excused
        (``current``: also the save of the failure under way, whose step is not yet judged)."""
        self.excused = self.excused or current
        for save in self.saves:
            if save["key"][0] not in self.committed:
                save["excused"] = True

    # storage
    def commit(self, name: str, fails: bool) -> None:
        plan, step = self.nodes[name].commits.pop(0)
        if fails:
            self.excuse()
            self.to_decider(ev.Committed(plan, False, "storage failed"))
            return
        key = self.plans[plan]
        got = self.shards.get((step, plan), {})
        bad = [r for r in self.ranks if got.get(r) != (key, True)]
        if bad:
            raise Violation(f"committed step {step} is incomplete: ranks {bad} lack verifying shards of {key}")
        if self.latest is not None and step < self.latest:
            raise Violation(f"latest moved back from {self.latest} to {step}")
        self.latest = step
        self.committed.append(step)
        self.saved_on_failure += plan in self.failure_plans
        self.to_decider(ev.Committed(plan, True))

    # -- invariants -----------------------------------------------------------------------------
    def check_restart_saved(self, final: bool = False) -> None:
        """Save-on-failure: the newest step every rank held is restored (restart) or committed (the end)."""
        truth = self.failure_truth
        if truth is None or self.excused:
            return
        if final:
            if self.latest is None or self.latest < truth[0]:
                raise Violation(f"the job ended without step {truth[0]}, held by every rank (latest {self.latest})")
        else:
            restored = self._restore_step()
            if restored < truth[0]:
                raise Violation(f"the restart resumed from step {restored}, every rank held step {truth[0]}")

    def summary(self) -> str:
        d = self.decider
        ranks = [(r.rank, r.node, r.alive, r.trained, r.slots) for r in self.ranks.values()]
        nodes = [(n.name, n.up, n.keeper_up, sorted(n.pins), n.todo) for n in self.nodes.values()]
        return (
            f"decider plan={d.plan} due={d.due} failure={d.failure}; ranks={ranks}; nodes={nodes}; "
            f"failing={self.failing} may_restart={self.may_restart} restarts={self.restarts}"
        )

    def check_end(self) -> None:
        """At quiescence: the job ended, each failure's save committed, no snapshot is left in memory."""
        if not self.ended:
            raise Violation(f"deadlock: nothing can happen and the job has not ended; {self.summary()}")
        for save in self.saves:
            step, floor = save["key"][0], save["floor"]
            if not save["excused"] and step not in self.committed and (floor is None or floor < step):
                raise Violation(f"save-on-failure never committed step {step}, held by every rank at the failure")
        left = [(r.rank, r.slots) for r in self.ranks.values() if any(r.slots) and self.nodes[r.node].up]
        left += [(n.name, n.copies) for n in self.nodes.values() if n.up and any(any(c) for c in n.copies.values())]
        if left:
            raise Violation(f"snapshots left in memory after the job ended: {left}")

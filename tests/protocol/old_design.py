"""The old multi-node design's rules, each as it was before the fix that removed it, for the explorer.

Each flag of ``OldRules`` turns one rule back on; ``OldDecider`` and the simulated keepers and agents
(``sim.py``) follow it. The rule, the commit that fixed (or, for the clock and timeout rules, still had)
it, and what the explorer sees:

- ``lost_by_timeout`` (the design before issue 30; 6a08e54 only shortened it to a heartbeat timeout):
  a participant lost mid-persist is noticed by a 120 s timeout, not by membership → a wait no event ends.
- ``restart_without_save`` (before ef1568b): the node's keeper saves on failure while the agent restarts
  at once; a keeper busy persisting looks only after the restarted workers replaced the owner records
  and sees no death → the newest step every rank held is never persisted.
- ``cursor_moved_on`` (before 2b2d89f): a keeper that began persisting step N on its own (the flag in
  its headers) publishes a cursor; a node whose cursor is past a step answers "missing" for it → rank 0
  died copying N, save-on-failure finds every older step missing, nothing is saved.
- ``dead_end_by_clock`` (ab51186's fix of the above, still in the code): the cursor's snapshot is a dead
  end when it was captured before the declared failure *by the participant's clock*; with that clock
  ahead of the coordinator's by more than the capture→failure gap the rule fails as if unfixed.
  ``dead_end_by_epoch`` is the same rule with the epoch comparison: it holds on any clock.
- ``preempt_waits_own_newest`` (before cd40b7f): a preempted node keeps its keeper until its own newest
  step is committed; when that step is newer than the one every rank holds, only Slurm's kill ends it.
- ``gone_epoch_from_job`` (before 68bc639): a keeper that reads its dead workers' records again after
  the next execution formed stamps their ``WorkersGone`` with job.json's epoch, already the new one →
  a failure of the new execution that no other node confirms holds every persist back for good.
- ``early_choice`` (before 300ad3b): the save-on-failure picks its step when the first node's workers
  are gone, from the others' non-final holdings, and settles "nothing" when they share none yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider import Decider
from stalwart.checkpoint.decider_events import Decision

OLD_TIMEOUT_S = 120.0  # the old persist's wait for a participant


@dataclass(frozen=True)
class StartTimer:
    """An old-design decision: wake me with ``Timeout(token)`` after ``seconds``. The decider of
    docs/protocol.md never asks for one; the old design's waits without an event show this way."""

    token: str
    seconds: float


@dataclass(frozen=True)
class Timeout:
    """The event of a ``StartTimer`` that fired."""

    token: str


@dataclass(frozen=True)
class OldRules:
    lost_by_timeout: bool = False
    restart_without_save: bool = False
    cursor_moved_on: bool = False
    dead_end_by_clock: bool = False
    dead_end_by_epoch: bool = False
    preempt_waits_own_newest: bool = False
    early_choice: bool = False
    gone_epoch_from_job: bool = False
    pin_on_sight: bool = True  # the keepers pin a step due for persistence when they see it (new design)


NEW = OldRules()
VARIANTS: dict[str, OldRules] = {
    "new": NEW,
    "lost_by_timeout": OldRules(lost_by_timeout=True),
    "restart_without_save": OldRules(restart_without_save=True),
    "cursor_moved_on": OldRules(cursor_moved_on=True),
    "dead_end_by_clock": OldRules(cursor_moved_on=True, dead_end_by_clock=True),
    "dead_end_by_epoch": OldRules(cursor_moved_on=True, dead_end_by_epoch=True),
    "preempt_waits_own_newest": OldRules(preempt_waits_own_newest=True),
    "early_choice": OldRules(early_choice=True),
    "gone_epoch_from_job": OldRules(gone_epoch_from_job=True),
    "no_pin_on_sight": OldRules(pin_on_sight=False),
}


class OldDecider(Decider):
    """The decider with the old design's rules switched back on (``rules``)."""

    def __init__(self, nodes: dict[str, list[int]], rules: OldRules) -> None:
        super().__init__(nodes)
        self.rules = rules

    def _lost_in_plan(self, node: str, out: list[Decision]) -> None:
        if not self.rules.lost_by_timeout:
            super()._lost_in_plan(node, out)
        elif not self.plan["committing"]:
            self._note(f"waiting {OLD_TIMEOUT_S:.0f} s for node {node}'s shards")
            out.append(StartTimer(f"plan-{self.plan['id']}", OLD_TIMEOUT_S))

    def _on_Timeout(self, e: Timeout, out: list[Decision]) -> None:
        if self.plan is not None and e.token == f"plan-{self.plan['id']}":
            self._end_plan("timed out waiting for a participant", out)

    def _open_failure(self, epoch: int, out: list[Decision]) -> bool:
        fresh = self.failure is None
        if not super()._open_failure(epoch, out):
            return False
        if fresh and self.rules.restart_without_save:
            # The keeper saves in parallel with the restart; busy persisting, it looks later, too late.
            self.failure["busy"] = self.plan is not None
            self._release_restart(None, "the keeper saves on failure", out)
        return True

    def _failure_ready(self) -> bool:
        if self.rules.restart_without_save and self.failure.get("busy") and self.epoch > self.failure["epoch"]:
            return False  # the restarted workers replaced the owner records: no death is seen
        if self.rules.early_choice:
            return bool(self.failure["final"])
        return super()._failure_ready()

    def _on_EpochBegan(self, e: ev.EpochBegan, out: list[Decision]) -> None:
        if self.rules.restart_without_save and self.failure is not None and self.failure.get("busy"):
            self._note("the busy keeper missed the death: no save-on-failure")
            self.failure = None
        super()._on_EpochBegan(e, out)

    def _save_on_failure(self, out: list[Decision]) -> None:
        if self.rules.early_choice:  # the others' holdings as last reported, not final
            self.failure["final"] = {n: self.failure["final"].get(n, self.held.get(n, {})) for n in self.nodes}
        super()._save_on_failure(out)

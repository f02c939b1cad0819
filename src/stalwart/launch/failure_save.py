"""The agent's save-on-failure: persist the newest snapshot every rank holds before the workers restart —
or, across nodes, only until every node holds it pinned, and the rest while the job trains again.

The restarted ranks restore from memory (same world), so the persist is for durability only. Across
nodes it is a multi-node commit that rank 0's node coordinates; it used to hold the restart (the
rendezvous waits for this agent) for its whole length, so a job spanning nodes recovered ~1.4 s slower
than one that does not. The restart must wait only until no restarted worker can overwrite the step:
once every node's keeper has pinned its snapshots of it (the coordinator has every node's table), the
double-buffered writers write their other slots, and the commit finishes in the background. Where a
node lacks the step (it died mid-copy), the save tries older ones, still before the restart.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from stalwart.checkpoint.decider_link import acting, decisions_mark
from stalwart.launch.detect import Incident

if TYPE_CHECKING:  # DCP is ~660 modules: `stalwart run --help` does not import it
    from stalwart.checkpoint.membership import LostNodes
    from stalwart.checkpoint.node_job import NodeJob

log = logging.getLogger("stalwart.agent")
PIN_WAIT_S = 60.0  # the most a restart waits for the step to be pinned (the save's own answer_s is 10 s)


class FailureSave:
    """The hook ``StalwartAgent(on_failure=...)`` calls after stopping the workers, for one node's job."""

    def __init__(self, job: NodeJob, members: LostNodes | None = None) -> None:
        self.job, self.members = job, members  # the master's lost nodes: a save never waits on one
        # The keepers act on the decider: its decisions from now on (not an earlier launch's) say when a
        # restart may proceed.
        self.mark = decisions_mark(members.address, members.token, members.me) if members and acting() else None
        self._background: list[threading.Thread] = []

    def __call__(self, incident: Incident | None) -> dict[str, Any]:
        """``incident`` None: a membership change, whose new world restores from storage — the save is
        made here and waited for, even where the keeper would make it."""
        job = self.job
        if not job.paths.job.exists():
            return {"persisted": False, "detail": "no flash checkpoints in this job"}
        if not job.persists():
            # Memory-only (no keeper on any node; multi-node waits would time out): nothing to persist,
            # the restarted workers restore from memory.
            return {"persisted": False, "detail": "memory-only checkpoints: the restart restores from memory"}
        if job.spans_nodes() and acting():
            if self.members is None:  # no master every node shares: the decider is rank 0's keeper's
                return {"persisted": None, "detail": "the keepers save on failure, as rank 0's keeper decides"}
            return self._decider_saves(commit=incident is None)
        if incident is None:
            return job.save_on_failure(quiet=True, members=self.members)
        if not job.spans_nodes():
            if job.keeper_alive():
                # It saw the worker die and saves on failure itself, in parallel with the restart (which
                # restores from memory); waiting for it here would only delay the restart.
                return {"persisted": False, "detail": "the node's keeper saves on failure"}
            return job.save_on_failure(quiet=True)
        # Not the keeper across nodes: one busy persisting when the worker died looks only after the
        # restarted worker has replaced its owner record, and misses the death.
        return self._until_pinned()

    def _decider_saves(self, commit: bool) -> dict[str, Any]:
        """The keepers act on the decider: its ``RestartMayProceed`` says when the restart may go on (and,
        for a new world that restores from storage, the commit it waits for)."""
        from stalwart.checkpoint.decider_actor import await_restart
        from stalwart.checkpoint.storage import Storage

        spec = self.job.job()
        storage = Storage(spec["storage"], spec.get("storage_options"))
        return await_restart(self.members, self.job.epoch(), lambda: storage, commit, PIN_WAIT_S, self.mark)

    def _until_pinned(self) -> dict[str, Any]:
        planned: list[int] = []
        pinned = threading.Event()
        result: dict[str, Any] = {}

        def on_planned(step: int) -> None:
            planned.append(step)
            pinned.set()

        def save() -> None:
            try:
                result.update(self.job.save_on_failure(quiet=True, on_planned=on_planned, members=self.members))
            except Exception as err:  # the restart went on: say it, as the synchronous save's caller would
                result.update(persisted=False, detail=f"save-on-failure failed: {err!r}")
                log.exception("save-on-failure failed")
            finally:
                pinned.set()
            if planned:  # the restart went on without waiting for this outcome
                log.info("save-on-failure (in the background): %s", result.get("detail"))

        thread = threading.Thread(target=save, name="stalwart-save-on-failure")
        thread.start()
        if not pinned.wait(PIN_WAIT_S):  # an earlier save holds the persist lock, a node does not answer
            self._background.append(thread)
            return {"persisted": None, "detail": f"not pinned within {PIN_WAIT_S:g} s: saving in the background"}
        if not thread.is_alive() or not planned:
            thread.join()
            return result
        self._background.append(thread)
        return {
            "persisted": None,
            "step": planned[0],
            "detail": f"every node holds step {planned[0]} pinned: it is persisted while the job restarts",
        }

    def wait(self, timeout_s: float = 120.0) -> None:
        """Before the agent exits (and stops its keeper): let the background saves commit."""
        for thread in self._background:
            thread.join(timeout_s)
            if thread.is_alive():
                log.error("save-on-failure still running after %.0f s; leaving it", timeout_s)
        self._background = [t for t in self._background if t.is_alive()]

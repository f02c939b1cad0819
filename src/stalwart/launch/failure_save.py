"""The agent's save-on-failure: persist the newest snapshot every rank holds before the workers restart
(one node: the keeper saves, or this agent when none runs) — or, across nodes, wait for the decider's
``RestartMayProceed``: every node holds the step pinned, so no restarted worker can overwrite it, and
the commit finishes while the job trains again (a new world that restores from storage waits for it).
The restarted ranks restore from memory (same world), so the persist is for durability only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from stalwart.checkpoint.decider_link import decisions_mark
from stalwart.launch.detect import Incident

if TYPE_CHECKING:  # DCP is ~660 modules: `stalwart run --help` does not import it
    from stalwart.checkpoint.desk_host import Membership
    from stalwart.checkpoint.node_job import NodeJob

log = logging.getLogger("stalwart.agent")
PIN_WAIT_S = 60.0  # the most a restart waits for the decider's word


class FailureSave:
    """The hook ``StalwartAgent(on_failure=...)`` calls after stopping the workers, for one node's job."""

    def __init__(self, job: NodeJob, members: Membership | None = None) -> None:
        self.job, self.members = job, members  # the master every node shares (None: there is none)
        # Its decisions from now on (not an earlier launch's) say when a restart may proceed.
        self.mark = decisions_mark(members.address, members.token, members.me) if members else None

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
        if job.spans_nodes():
            if self.members is None:  # no master every node shares: the decider is rank 0's keeper's
                return {"persisted": None, "detail": "the keepers save on failure, as rank 0's keeper decides"}
            return self._decider_saves(commit=incident is None)
        if incident is not None and job.keeper_alive():
            # It saw the worker die and saves on failure itself, in parallel with the restart (which
            # restores from memory); waiting for it here would only delay the restart.
            return {"persisted": False, "detail": "the node's keeper saves on failure"}
        return job.save_on_failure(quiet=True)

    def _decider_saves(self, commit: bool) -> dict[str, Any]:
        """The keepers act on the decider: its ``RestartMayProceed`` says when the restart may go on (and,
        for a new world that restores from storage, the commit it waits for)."""
        from stalwart.checkpoint.decider_actor import await_restart
        from stalwart.checkpoint.storage import Storage

        assert self.members is not None
        spec = self.job.job()
        storage = Storage(spec["storage"], spec.get("storage_options"))
        return await_restart(self.members, self.job.epoch(), lambda: storage, commit, PIN_WAIT_S, self.mark)

"""What the agent tells the master's journal: incidents with their timeline, worker reports, regroups.

The master may be briefly away (a restarted master resumes from its SQLite journal): a failed call is
logged and dropped, never allowed to stop the recovery it describes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from stalwart.launch import detect
from stalwart.launch.client import MasterClient, MasterError
from stalwart.launch.detect import Incident

log = logging.getLogger("stalwart.agent")


class AgentJournal:
    def __init__(self, master: MasterClient, node_id: str) -> None:
        self.master, self.node_id = master, node_id

    def _call(self, call: Callable[[], Any]) -> None:
        try:
            call()
        except (MasterError, OSError) as err:
            log.error("could not journal to the master: %s", err)

    def opened(self, incident: Incident) -> None:
        """Journal a detected incident; its id (for the later timestamps) is set on ``incident``."""
        times = {"detected": incident.detected}
        if incident.fault is not None:
            times["fault"] = incident.fault

        def call() -> None:
            incident.id = self.master.open_incident(incident.kind, self.node_id, incident.cls, times, incident.details)

        self._call(call)

    def restarted(self, incident: Incident | None, stopped: float, restarted: float, saved: dict[str, Any]) -> None:
        """The workers were stopped and started again: for a fault, its timeline; else a regroup."""
        if incident is None:
            self._call(
                lambda: self.master.decide(
                    "regroup",
                    "membership changed: workers restarted without a fault",
                    {"node_id": self.node_id, "save_on_failure": saved},
                )
            )
        elif incident.id is not None:
            self._call(
                lambda: self.master.update_incident(
                    incident.id,
                    {"stopped": stopped, "restarted": restarted},
                    {"save_on_failure": saved} if saved else None,
                )
            )

    def first_step(self, incident: Incident, first: float, warm: bool) -> None:
        """Every rank has reported a step since the restart: the incident's last timestamp."""
        incident.details.update(first_step=first, warm_start=warm)
        if incident.id is not None:
            self._call(lambda: self.master.update_incident(incident.id, {"first_step": first}, {"warm_start": warm}))

    def worker_reports(self, records: Iterable[dict[str, Any]]) -> None:
        """Journal what workers reported themselves (see ``stalwart.incident``); an ``sdc`` with
        ``evict`` also journals a decision naming this node (the eviction itself is a later step)."""
        now = time.time()
        for record in records:
            report = detect.worker_report(record, self.node_id, now)
            log.warning(
                "worker incident on rank %s at step %s: %s %s",
                record.get("rank"),
                record.get("step"),
                report.kind,
                record.get("detail"),
            )
            self._call(lambda r=report: self.master.open_incident(r.kind, self.node_id, r.cls, r.times, r.details))
            if report.evict_reason is not None:
                details = {"node_id": self.node_id, "rank": record.get("rank"), "step": record.get("step")}
                self._call(lambda r=report, d=details: self.master.decide("evict", r.evict_reason, d))

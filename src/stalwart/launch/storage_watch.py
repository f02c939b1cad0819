"""The agent's view of its node's checkpoint store: what the keeper reports, brought to the user.

The keeper (a separate process, see ``stalwart.checkpoint.storage_health``) appends a ``storage``
incident to ``storage.incidents.jsonl`` when persists start to fail (with the cause: full, permission,
unreachable, timeout, torn) and when they recover, and keeps its storage status in a file the agent
names (``--status-copy``); both live in the agent's run directory, so they outlive the job's
shared-memory directory, which the keeper removes at the end (with the final pass's records). Each
monitor tick the agent reads both through this watch: it prints each incident on the console, journals
it with the master, and passes the status on to the heartbeat (``/metrics``) and the job report. Files
only: launch does not import the checkpoint package.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from stalwart.launch.evidence import IncidentTail

INCIDENTS = "storage.incidents.jsonl"


class StorageWatch:
    def __init__(self, status_file: Path) -> None:
        """``status_file``: where the agent's keeper keeps a copy of its status (``--status-copy``);
        its incidents are appended beside it."""
        self.status_file = Path(status_file)
        self.tail = IncidentTail(INCIDENTS)
        self.status: dict[str, Any] | None = None  # the newest status seen (kept after the keeper tidies)

    def __call__(self) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """New incident records (printed here) and the keeper's storage status."""
        records = self.tail.read(self.status_file.parent)
        try:
            status = json.loads(self.status_file.read_text()).get("storage")
        except (OSError, ValueError, AttributeError):
            status = None
        if isinstance(status, dict):
            self.status = status
        for r in records:
            print(f"stalwart: {describe(r)}", file=sys.stderr, flush=True)
        return records, self.status


def describe(record: dict[str, Any]) -> str:
    """One console line for a keeper's storage incident."""
    d = record.get("detail") or {}
    committed = d.get("last_committed", -1)
    last = committed if isinstance(committed, int) and committed >= 0 else "none"
    if d.get("recovered"):
        return (
            f"storage recovered: step {record.get('step')} committed to {d.get('url')} after "
            f"{d.get('failed_attempts')} failed attempt(s) over {d.get('down_s')} s ({d.get('cause')})"
        )
    return (
        f"storage {d.get('cause')}: {d.get('op')} of step {record.get('step')} to {d.get('url')} failed "
        f"({d.get('error')}); training continues from memory, retrying with backoff (last committed step: {last})"
    )

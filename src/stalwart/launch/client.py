"""Client for the job master: JSON over HTTP with the job token, retrying through master restarts."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from stalwart.runtime.master_call import MasterError, call_master

__all__ = ["ADDRESS_FILE", "MasterClient", "MasterError", "write_address"]

ADDRESS_FILE = "master.json"


def write_address(run_dir: Path, address: str, job_id: str, node_id: str) -> None:
    """RUN_DIR/master.json names the job's master, for `stalwart chaos --run-dir` and scripts (the
    token stays in RUN_DIR/token when the master runs in `stalwart run`; a separate master's is not copied)."""
    tmp = run_dir / (ADDRESS_FILE + ".tmp")
    tmp.write_text(json.dumps({"address": address, "job_id": job_id, "node_id": node_id, "pid": os.getpid()}))
    os.replace(tmp, run_dir / ADDRESS_FILE)


class MasterClient:
    """The master's API for one agent (its main loop and heartbeat thread share it).

    Connection failures are retried for ``retry_for_s``, counted from when the master was first found
    unreachable, not per call: an agent whose master is gone for good then meets each call's failure after
    one attempt, instead of waiting ``retry_for_s`` again for the journal, the restart decision and the lost
    nodes of every incident (a minute and more per restart, with the local budget deciding anyway)."""

    def __init__(self, address: str, token: str, timeout_s: float = 5.0, retry_for_s: float = 30.0) -> None:
        self.address = address.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        self.unreachable_since: float | None = None  # monotonic; None while the last call got through
        self._answered_at = float("-inf")  # when the newest answer came

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, retry_for_s: float | None = None
    ) -> dict[str, Any]:
        """One API call (``runtime.master_call``): connection failures retried for ``retry_for_s``."""
        started = time.monotonic()
        retry = self.retry_for_s if retry_for_s is None else retry_for_s
        if (since := self.unreachable_since) is not None:
            retry = max(0.0, min(retry, since + self.retry_for_s - started))
        try:
            reply = call_master(self.address, self.token, method, path, body, self.timeout_s, retry)
        except MasterError:
            self._answered()  # an error answer is an answer
            raise
        except OSError:
            # Not when another thread's call got an answer while this one waited (a heartbeat timing out)
            if self.unreachable_since is None and self._answered_at < started:
                self.unreachable_since = started
            raise
        self._answered()
        return reply

    def _answered(self) -> None:
        self._answered_at = time.monotonic()
        self.unreachable_since = None

    # Convenience wrappers, one per route.
    def join(self, node_id: str, host: str, nproc: int, info: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.call(
            "POST", "/v1/nodes/join", {"node_id": node_id, "host": host, "nproc": nproc, "info": info or {}}
        )

    def heartbeat(self, node_id: str, progress: dict[str, Any], info: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"node_id": node_id, "progress": progress}
        if info is not None:
            body["info"] = info
        return self.call("POST", "/v1/nodes/heartbeat", body)

    def open_incident(
        self,
        kind: str,
        node_id: str | None = None,
        cls: str | None = None,
        times: dict[str, float] | None = None,
        details: dict[str, Any] | None = None,
    ) -> int:
        return self.call(
            "POST",
            "/v1/incidents",
            {"kind": kind, "node_id": node_id, "class": cls, "times": times or {}, "details": details or {}},
        )["id"]

    def update_incident(self, incident_id: int, times: dict[str, float], details: dict[str, Any] | None = None) -> None:
        body: dict[str, Any] = {"times": times}
        if details is not None:
            body["details"] = details
        self.call("PATCH", f"/v1/incidents/{incident_id}", body)

    def request_restart(self, reason: str, node_id: str | None = None, round_: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"reason": reason, "node_id": node_id}
        if round_ is not None:
            body["round"] = round_
        return self.call("POST", "/v1/restarts", body)

    def decide(self, action: str, reason: str, details: dict[str, Any] | None = None) -> int:
        return self.call("POST", "/v1/decisions", {"action": action, "reason": reason, "details": details or {}})["id"]

    def chaos(self, spec: str) -> int:
        return self.call("POST", "/v1/chaos", {"spec": spec})["id"]

    def status(self) -> dict[str, Any]:
        return self.call("GET", "/v1/status")

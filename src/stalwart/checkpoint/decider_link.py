"""A keeper's line to the checkpoint decider (docs/protocol.md): ``exchange(events, after) → decisions`` over
``POST /v1/ckpt``. The keeper's loop never waits on the network: a thread sends queued events in order, keeps
those the master did not take for the next call, and hands decisions back through ``take()``. A master that
does not answer costs only delay (the queue is bounded; a newer ``Holding`` replaces a queued one).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from stalwart.checkpoint import decider_wire as wire
from stalwart.runtime.master_call import call_master

log = logging.getLogger("stalwart.checkpoint")
MAX_QUEUED = 10_000  # a master gone for long: the oldest reports go
MAX_BATCH = 200  # events per call (the master refuses bodies over 1 MiB; a Holding is ~200 B)


def decisions_mark(address: str, token: str, node: str) -> int | None:
    """The number of the master's newest decision now (None: no answer), so that an agent reads only later
    ones: an earlier launch's decisions, kept in a shared journal, come before its start."""
    try:
        body = {"node": node, "events": [], "after": None}
        return int(call_master(address.rstrip("/"), token, "POST", "/v1/ckpt", body, 2.0, retry_for_s=0)["next"]) - 1
    except Exception as err:  # any failure of the call: the read then takes every decision kept
        log.warning("decider link: no mark of the master's decisions (%s)", err)
        return None


class DeciderLink:
    """Events out and decisions in, for node ``node``, through the master at ``address``."""

    def __init__(self, address: str, token: str, node: str, every_s: float = 0.1, idle_s: float = 1.0) -> None:
        self.address, self.token, self.node, self.every_s = address.rstrip("/"), token, node, every_s
        self.idle_s = idle_s  # the call's period with nothing queued and no answer awaited (a big job's
        # master hears each node about once a second, not ten times)
        self.eager = False  # set by the owner while it awaits decisions: call every ``every_s``
        self.after: int | None = None  # the number of the last decision read (None: start from the next)
        self.missed = False  # decisions dropped before this keeper read them: report holdings again
        self.formed = False  # the master has a decider for this job (its nodes reported their ranks)
        self._queue: list[tuple[int, dict[str, Any]]] = []  # (number, event as JSON)
        self._numbered = 0
        self._decisions: list[Any] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._exchanges = 0  # calls answered so far
        self._failures = 0  # calls that failed so far
        self.failing = False  # the last call failed (the master is gone, or listens elsewhere now)
        self._said = ""  # the last failure logged (each new one once)
        self._thread: threading.Thread | None = None  # started by the first event: a job that never
        # reports (one node) costs no calls

    def send(self, *events: Any) -> None:
        """Queue events (``decider_events``) for the next call; never blocks on the network."""
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="stalwart-decider-link", daemon=True)
                self._thread.start()
            for event in events:
                data = wire.to_json(event)
                if data["kind"] == "Holding":  # a full report: an older one still queued says nothing more
                    self._queue = [q for q in self._queue if q[1]["kind"] != "Holding"]
                self._numbered += 1
                self._queue.append((self._numbered, data))
            if (dropped := len(self._queue) - MAX_QUEUED) > 0:
                del self._queue[:dropped]
                log.warning("decider link: the master has not answered; dropped %d old report(s)", dropped)
        self._wake.set()

    def take(self) -> list[Any]:
        """The decisions received since the last ``take``, in the decider's order."""
        with self._lock:
            out, self._decisions = self._decisions, []
        return out

    def sync(self, timeout_s: float) -> bool:
        """Wait (bounded) for a call that starts after now: what is queued is sent and the decisions made
        until then are read. False at once when a call fails (the master is gone), or after ``timeout_s``."""
        with self._lock:
            if self._thread is None:
                return False  # nothing was ever sent
            target, failures = self._exchanges + 2, self._failures  # one may be under way, older
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._wake.set()
            with self._lock:
                if self._exchanges >= target:
                    return True
                if self._failures > failures:
                    return False
            time.sleep(0.01)
        return False

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=3)  # a call times out after 2 s

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                busy = bool(self._queue) or self.eager
            self._wake.wait(self.every_s if busy else self.idle_s)
            self._wake.clear()
            try:
                self._exchange()
            except Exception as err:  # the link must outlive any failure: the next call carries the reports
                with self._lock:
                    self._failures += 1
                    self.failing = True
                if str(err) != self._said:
                    self._said = str(err)
                    log.warning("decider link: no exchange with the master (%s); the next call tries again", err)

    def _exchange(self) -> None:
        with self._lock:
            batch = self._queue[:MAX_BATCH]
        body = {"node": self.node, "events": [data for _, data in batch], "after": self.after}
        reply = call_master(self.address, self.token, "POST", "/v1/ckpt", body, 2.0, retry_for_s=0)
        decisions = []
        for data in reply["decisions"]:
            try:
                decisions.append(wire.from_json(data, wire.DECISIONS))
            except (ValueError, TypeError) as err:  # a master of another version: skip it, and say so
                log.warning("decider link: skipped a decision this keeper cannot read (%s)", err)
        with self._lock:
            sent = {number for number, _ in batch[: int(reply["taken"])]}
            self._queue = [q for q in self._queue if q[0] not in sent]
            self._decisions.extend(decisions)
            self.after = int(reply["next"]) - 1
            self.missed = self.missed or bool(reply.get("missed"))
            self._exchanges += 1
            self.failing = False
            self.formed = reply.get("epoch") is not None
            self._said = ""

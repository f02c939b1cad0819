"""A keeper's line to the checkpoint decider: one call, ``exchange(events, after) → decisions``.

Under ``stalwart run`` the decider lives in the job master (``launch/master_ckpt.py``, ``POST
/v1/ckpt``). The keeper's loop never waits on the network: it queues events, and a thread sends them in
order with the number of the last decision it read, keeps those the master did not take yet (they came
before the execution formed, or belong to an epoch not yet formed there) for the next call, and hands
the decoded decisions back through ``take()``. A master that does not answer costs nothing but delay:
the queue waits (bounded) and the next call carries it. JSON both ways, never pickle.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from stalwart.checkpoint import decider_wire as wire
from stalwart.runtime.master_call import MasterError, call_master

log = logging.getLogger("stalwart.checkpoint")
MAX_QUEUED = 10_000  # a master gone for long: the oldest reports go (a Holding report is repeated anyway)


class DeciderLink:
    """Events out and decisions in, for node ``node``, through the master at ``address``."""

    def __init__(self, address: str, token: str, node: str, every_s: float = 0.1, idle_s: float = 1.0) -> None:
        self.address, self.token, self.node, self.every_s = address.rstrip("/"), token, node, every_s
        self.idle_s = idle_s  # the call's period with nothing queued and no answer awaited (a big job's
        # master hears each node about once a second, not ten times)
        self.eager = False  # set by the owner while it awaits decisions: call every ``every_s``
        self.after: int | None = None  # the number of the last decision read (None: start from the next)
        self.missed = False  # decisions dropped before this keeper read them: report holdings again
        self._queue: list[dict[str, Any]] = []
        self._decisions: list[Any] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._exchanges = 0  # calls answered so far
        self.formed = False  # the master has a decider for this job (its nodes reported their ranks)
        self._thread: threading.Thread | None = None  # started by the first event: a job that never
        # reports (one node) costs no calls

    def send(self, *events: Any) -> None:
        """Queue events (``decider_events``) for the next call; never blocks on the network."""
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="stalwart-decider-link", daemon=True)
                self._thread.start()
            self._queue.extend(wire.to_json(e) for e in events)
            dropped = len(self._queue) - MAX_QUEUED
            if dropped > 0:
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
        until then are read. False if the master did not answer in time."""
        with self._lock:
            if self._thread is None:
                return False  # nothing was ever sent
            target = self._exchanges + 2  # one may be under way with an older queue
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._wake.set()
            with self._lock:
                if self._exchanges >= target:
                    return True
            time.sleep(0.01)
        return False

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._closed:
            with self._lock:
                busy = bool(self._queue) or self.eager
            self._wake.wait(self.every_s if busy else self.idle_s)
            self._wake.clear()
            try:
                self._exchange()
            except (OSError, ValueError, KeyError, TypeError, MasterError) as err:
                log.debug("decider link: no exchange with the master (%s); the next call carries the reports", err)

    def _exchange(self) -> None:
        with self._lock:
            events = list(self._queue)
        body = {"node": self.node, "events": events, "after": self.after}
        reply = call_master(self.address, self.token, "POST", "/v1/ckpt", body, 2.0, retry_for_s=0)
        decisions = [wire.from_json(d, wire.DECISIONS) for d in reply["decisions"]]
        with self._lock:
            del self._queue[: int(reply["taken"])]
            self._decisions.extend(decisions)
            self.after = int(reply["next"]) - 1
            self.missed = self.missed or bool(reply.get("missed"))
            self._exchanges += 1
            self.formed = reply.get("epoch") is not None

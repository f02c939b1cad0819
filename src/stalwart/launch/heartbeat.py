"""The agent's heartbeat to the master, and what it shares with the monitor loop.

Two threads meet here. The monitor loop (``StalwartAgent._invoke_run``) records each tick's progress;
the heartbeat thread sends it to the master once a second with a straggler window every ``window_s``,
and brings back faults injected with ``stalwart chaos`` (appended to the chaos file the workers watch)
and the master's eviction. ``NodeStatus`` holds everything both threads touch, behind one lock.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stalwart.launch.client import MasterClient, MasterError
from stalwart.launch.presence import Presence
from stalwart.launch.progress import Progress
from stalwart.observe import histo

log = logging.getLogger("stalwart.agent")


class NodeStatus:
    """This node's latest progress, straggler window, membership and eviction, shared by the monitor
    loop (writer of progress, reader of eviction) and the heartbeat thread (the other way round)."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._latest: list[Progress] = []
        self._window: dict[int, list[float]] = {}  # rank → compute seconds of steps in this window
        self._spans: dict[int, tuple[float, int, float, int]] = {}  # rank → first and last (time, reports)
        self._window_start = clock()
        self._seen_reports: dict[int, int] = {}
        # True: this node's workers are in the current rendezvous round; False: it waits at the
        # rendezvous (a spare while a round runs); None: not at the rendezvous yet (starting, prechecking)
        self._member: bool | None = None
        self._round: int | None = None  # the last rendezvous round this node's workers were in
        self._leave: str | None = None
        self._parked = False  # the leave is a park (the autoscaler's shrink): wait as a spare, not exit
        self._storage: dict[str, Any] | None = None  # the keeper's checkpoint-store status

    def observe(self, progress: list[Progress]) -> None:
        """The monitor's tick: the latest records, and each new step's compute time for the window."""
        with self._lock:
            self._latest = list(progress)
            for p in progress:
                if p.reports > self._seen_reports.get(p.rank, 0) and p.compute_s == p.compute_s:
                    self._window.setdefault(p.rank, []).append(p.compute_s)
                    first = self._spans.get(p.rank, (p.time, p.reports))[:2]
                    self._spans[p.rank] = (*first, p.time, p.reports)
                self._seen_reports[p.rank] = p.reports

    def new_attempt(self) -> None:
        """Workers (re)start with fresh records: report counts start over."""
        with self._lock:
            self._seen_reports.clear()

    def set_storage(self, storage: dict[str, Any] | None) -> None:
        with self._lock:
            self._storage = storage

    def set_member(self, member: bool | None, round_: int | None = None) -> None:
        """``round_``: with ``member`` True, the round the workers joined; a node that leaves it to
        regroup keeps naming it, so the master does not take a regrouping member for a spare."""
        with self._lock:
            self._member = member
            if member and round_ is not None:
                self._round = round_

    def evict(self, reason: str) -> bool:
        """Record that this node must leave (the first reason wins); True when it is new."""
        with self._lock:
            if self._leave is not None:
                return False
            self._leave = reason
            return True

    def park(self, reason: str) -> bool:
        """Record that this node must step out and wait as a parked spare; True when it is new."""
        with self._lock:
            if self._leave is not None:
                return False
            self._leave, self._parked = reason, True
            return True

    @property
    def parked(self) -> bool:
        with self._lock:
            return self._parked

    @property
    def leave(self) -> str | None:
        with self._lock:
            return self._leave

    def report(self, now: float) -> dict[str, Any]:
        """The heartbeat's ``progress`` body; closes the straggler window when it is due."""
        with self._lock:
            ranks = [
                {
                    "rank": p.rank,
                    "step": p.step,
                    "phase": p.phase,
                    "age_s": round(now - p.time, 3),
                    "loss": None if p.loss != p.loss else p.loss,
                }
                for p in self._latest
            ]
            body: dict[str, Any] = {"ranks": ranks, "member": self._member, "round": self._round}
            if self._storage is not None:
                body["storage"] = self._storage
            window = self._close_window()
            if window is not None:
                body["window"] = window
            return body

    def _close_window(self) -> dict[str, float] | None:
        """Every window_s: the slowest local rank's median compute time per step (None otherwise)."""
        if self._clock() - self._window_start < self.window_s:
            return None
        self._window_start = self._clock()
        samples, self._window = self._window, {}
        spans, self._spans = self._spans, {}
        medians = [statistics.median(v) for v in samples.values() if v]
        if not medians:
            return None
        window = {"compute_s": max(medians), "steps": sum(len(v) for v in samples.values())}
        # Wall time per step (the autoscaler's step time): between a rank's first and last report of
        # the window, so a restart or the start-up before the first step does not count.
        per_step = [(t1 - t0) / (n1 - n0) for (t0, n0, t1, n1) in spans.values() if n1 > n0]
        if per_step:
            window["step_s"] = statistics.median(per_step)
        return window


class ChaosInbox:
    """Faults injected into the running job, appended to the chaos file (replaced atomically: a worker
    never reads half a line); workers re-read it when its mtime changes, the rank/step keys pick who fires."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen = 0  # id of the last injected fault applied

    def apply(self, specs: list[dict[str, Any]]) -> None:
        if not specs:
            return
        lines = self.path.read_text() if self.path.exists() else ""
        lines += "".join(f"{s['spec']}\n" for s in specs)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(lines)
        os.replace(tmp, self.path)
        self.seen = max(int(s["id"]) for s in specs)
        log.warning("chaos: injected %s", [s["spec"] for s in specs])


class Heartbeat:
    """A daemon thread: one beat every ``interval_s`` until ``stop``. ``worker_state`` names the worker
    group's state (informational for the master)."""

    def __init__(
        self,
        master: MasterClient,
        node_id: str,
        status: NodeStatus,
        local_world_size: int,
        worker_state: Callable[[], str],
        interval_s: float = 1.0,
        chaos: ChaosInbox | None = None,
        hist_dir: Path | None = None,
        presence: Presence | None = None,
    ) -> None:
        self.master, self.node_id, self.status = master, node_id, status
        self.hist_dir = hist_dir  # the ranks' step/section histograms (observe.histo), for /metrics
        self.local_world_size = local_world_size
        self.worker_state = worker_state
        self.interval_s = interval_s
        self.chaos = chaos
        self._stop = threading.Event()
        self._final_sent = False
        self._thread = threading.Thread(target=self._loop, name="stalwart-heartbeat", daemon=True)
        self._missed = 0  # beats in a row without an answer (backoff)
        self._presence = presence  # held open from start to stop: the master sees a dead agent at once

    def start(self) -> None:
        self._thread.start()
        if self._presence is not None:
            self._presence.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating, after one last beat: the master's view (status, /metrics) ends with the node's
        final step and histograms, not with whatever the last periodic beat happened to catch."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.ident is not None and not self._thread.is_alive() and not self._final_sent:
            self._final_sent = True
            self.beat()
        if self._presence is not None:
            self._presence.close()  # leaving on purpose: not lost
            self._presence = None

    def _loop(self) -> None:
        while not self._stop.wait(self.next_wait()):
            self.beat()

    def next_wait(self) -> float:
        """The interval (the master scales it with the job's size at join), ±10 % jitter so that
        thousands of agents do not beat in step, doubled per unanswered beat up to 30 s (backoff)."""
        base = self.interval_s * min(2.0**self._missed, max(1.0, 30.0 / self.interval_s))
        return base * random.uniform(0.9, 1.1)

    def beat(self) -> None:
        """Send one heartbeat; apply what the reply brings (injected faults, eviction)."""
        body = {"state": self.worker_state(), **self.status.report(time.time())}
        if self.hist_dir is not None:
            body["hist"] = histo.read_node(self.hist_dir)
        beat: dict[str, Any] = {"node_id": self.node_id, "progress": body}
        if self.chaos is not None:
            beat["chaos_after"] = self.chaos.seen
        try:
            reply = self.master.call("POST", "/v1/nodes/heartbeat", beat, retry_for_s=0)
            self._missed = 0
            if self.chaos is not None:
                self.chaos.apply(reply.get("chaos") or [])
            if reply.get("leave") and self.status.evict(str(reply["leave"])):
                log.warning("evicted by the master: %s", reply["leave"])
            if reply.get("park") and self.status.park(str(reply["park"])):
                log.warning("parked by the master: %s", reply["park"])
        except MasterError as err:
            if err.status == 404:  # a master that lost its journal: join again
                try:
                    self.master.join(self.node_id, socket.gethostname(), self.local_world_size)
                except (MasterError, OSError) as join_err:
                    log.error("could not journal to the master: %s", join_err)
        except OSError:
            self._missed += 1  # the master may be restarting: the next beat tries again, later

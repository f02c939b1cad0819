"""A slow node on demand: the agent stops its workers in proportion to the CPU time they use.

Straggler detection compares the compute time per step that workers report; a sleep between steps
would not show there, and a real slow node (thermal throttling, a noisy neighbour) slows the work
itself. So, like ``cpulimit``: every few milliseconds the agent reads how much CPU time each worker's
main thread used (``/proc/PID/schedstat``, nanoseconds) and, for every second of it, stops the workers
(SIGSTOP … SIGCONT) for ``factor − 1`` seconds. Work then takes ``factor``× as long wherever it falls,
and a worker that sleeps or waits costs nothing — a fixed stop/continue period would instead stretch
sections at random, depending on how they line up with the period. Chaos ``slow:at=node[:factor=F]``
turns it on (see ``stalwart.chaos.faults``); it exists for tests and demos only (CPU work; a GPU
kernel would not be slowed). ``stalwart run --share-with`` sets the factor as it goes (``set_factor``;
``math.inf`` holds the workers stopped) to keep an opportunistic job out of a production job's way.
"""

from __future__ import annotations

import bisect
import math
import os
import signal
import threading
import time
from collections.abc import Callable


def cpu_ns(pid: int) -> int | None:
    """Nanoseconds the process's main thread has run on a CPU (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Throttle:
    """Makes the processes `pids()` names (re-read every tick: restarted workers are throttled too)
    `factor`× slower. `pause()` lets them run freely (while they are being stopped for good)."""

    MAX_STOP_S = 0.5  # the longest single stop (a larger debt is forgiven: the thread was starved)

    def __init__(self, pids: Callable[[], list[int]], factor: float, tick_s: float = 0.002) -> None:
        if factor <= 1.0 or tick_s <= 0:
            raise ValueError(f"a node slowdown needs factor > 1 and tick_s > 0 (got {factor}, {tick_s})")
        self.pids, self.factor, self.tick_s = pids, factor, tick_s
        self._active = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a stop/continue completes before pause() returns
        self._seen: dict[int, int] = {}  # pid → CPU ns at the last tick
        self.stopped_s = 0.0  # total time the workers were held, for tests and logs
        # Every stop, as wall-clock (start, end) and the total held by its end: the agent does not count
        # held time as a worker's silence (``stopped_since``).
        self._spans: list[tuple[float, float, float]] = []
        self._held_from: float | None = None
        self._spans_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="stalwart-throttle", daemon=True)

    def start(self) -> Throttle:
        self._active.set()
        self._thread.start()
        return self

    def pause(self) -> None:
        self._active.clear()
        with self._lock:
            self._signal(list(self._seen), signal.SIGCONT)

    def resume(self) -> None:
        self._active.set()

    def set_factor(self, factor: float) -> None:
        """From now on work takes ``factor``× as long (1: free; ``math.inf``: held stopped until changed)."""
        if not factor >= 1.0:
            raise ValueError(f"a throttle factor must be ≥ 1 or inf (got {factor})")
        self.factor = factor

    def close(self) -> None:
        self._stop.set()
        self._active.set()
        self._thread.join(2)
        self._signal(list(self._seen), signal.SIGCONT)

    @staticmethod
    def _signal(pids: list[int], sig: signal.Signals) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _debt_s(self, factor: float) -> float:
        """Seconds to hold the workers for the CPU time they used since the last tick."""
        used, seen = 0, {}
        for pid in self.pids():
            now = cpu_ns(pid)
            if now is None:
                continue
            used = max(used, now - self._seen.get(pid, now))  # the busiest worker sets the pace
            seen[pid] = now
        self._seen = seen
        return used * 1e-9 * (factor - 1)

    def _loop(self) -> None:
        try:
            self._duty_cycle()
        finally:  # whatever ended the loop, no worker is left stopped
            self._signal(list(self._seen), signal.SIGCONT)

    def _duty_cycle(self) -> None:
        debt = 0.0
        while not self._stop.wait(self.tick_s):
            if not self._active.wait(1.0):
                continue
            factor = self.factor  # read once: ``set_factor`` may change it meanwhile (to inf, too)
            if math.isinf(factor):
                self._hold()
                debt = 0.0
                continue
            debt += self._debt_s(factor)
            if debt < self.tick_s:
                continue
            with self._lock:
                if not self._active.is_set():
                    continue
                pids = list(self._seen)
                self._began_stop()
                self._signal(pids, signal.SIGSTOP)
                try:  # a starved tick may owe much: at most MAX_STOP_S, so a new factor acts soon
                    self._stop.wait(min(debt, self.MAX_STOP_S))
                finally:
                    self._signal(pids, signal.SIGCONT)
                    self._ended_stop()
            debt = 0.0
            self._debt_s(factor)  # the held time is not CPU time: start counting afresh

    def _hold(self) -> None:
        """Keep the workers stopped (new ones too) while the factor is infinite and the throttle active."""
        with self._lock:
            held: set[int] = set()
            self._began_stop()
            try:
                while math.isinf(self.factor) and self._active.is_set() and not self._stop.is_set():
                    fresh = [pid for pid in self.pids() if pid not in held]
                    self._signal(fresh, signal.SIGSTOP)
                    held.update(fresh)
                    self._stop.wait(self.tick_s * 5)
            finally:
                self._signal(list(held), signal.SIGCONT)
                self._ended_stop()
        self._debt_s(1.0)  # the held time is not CPU time: start counting afresh

    # -- held time, for the hang detector ---------------------------------------------------------------
    def _began_stop(self) -> None:
        self._held_from = time.time()

    def _ended_stop(self) -> None:
        now = time.time()
        with self._spans_lock:
            start, self._held_from = self._held_from or now, None
            self.stopped_s += now - start
            self._spans.append((start, now, self.stopped_s))
            if len(self._spans) > 50_000:  # hours of ticks: what a silence allowance spans is far newer
                del self._spans[:25_000]

    def stopped_since(self, since: float) -> float:
        """Seconds the workers were held stopped after wall-clock time ``since`` (up to now)."""
        with self._spans_lock:
            now, held_from, spans = time.time(), self._held_from, self._spans
            total = self.stopped_s + (now - held_from if held_from is not None else 0.0)
            i = bisect.bisect_right(spans, since, key=lambda span: span[1])  # the first span ending after it
            if i < len(spans):  # held before ``since``: the spans before i, and the part of span i before it
                start, end, held_by_end = spans[i]
                before = held_by_end - (end - start) + max(0.0, since - start)
            else:
                before = self.stopped_s + (max(0.0, since - held_from) if held_from is not None else 0.0)
            return max(0.0, total - before)

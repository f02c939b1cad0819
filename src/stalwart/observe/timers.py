"""Section timers for the training step: where a step's time goes, at ~1 µs per section, no host sync.

    timer = SectionTimer(device)
    with timer.section("forward"): ...
    with timer.section("comm_wait", compute=False): ...
    sections = timer.step_done()   # {"forward": 0.012, ..., "compute_s": ..., "wait_s": ...} or None

On the CPU, sections are timed with perf_counter and ``step_done`` returns this step's times. On
CUDA, sections record events on the current stream and are resolved *late*: ``step_done`` returns
the times of the newest earlier step whose events the GPU has passed (``Event.query``, which never
waits) — normally the previous step — or None when none has finished yet. Nothing here synchronises,
so the host keeps queueing work ahead of the GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

Section = tuple[str, bool, Any, Any]  # name, counts as compute, start event, end event


def summarize(totals: dict[str, float], wait: set[str]) -> dict[str, float]:
    """Seconds per section plus ``compute_s`` (the step's own work) and ``wait_s`` (communication)."""
    out = dict(totals)
    out["compute_s"] = sum(v for k, v in totals.items() if k not in wait)
    out["wait_s"] = sum(v for k, v in totals.items() if k in wait)
    return out


class SectionTimer:
    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self._open: list[Section] = []  # CUDA: this step's sections
        self._pending: deque[list[Section]] = deque()  # CUDA: finished steps not yet resolved
        self._totals: dict[str, float] = {}
        self._wait: set[str] = set()

    @contextlib.contextmanager
    def section(self, name: str, compute: bool = True) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._open.append((name, compute, start, end))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._add(name, compute, time.perf_counter() - t0)

    def _add(self, name: str, compute: bool, seconds: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + seconds
        if not compute:
            self._wait.add(name)

    def discard(self) -> None:
        """Forget the current step's sections (a step that was not applied belongs to no step)."""
        self._open.clear()
        self._totals.clear()
        self._wait.clear()

    def step_done(self) -> dict[str, float] | None:
        """End of a step. CPU: its seconds per section plus ``compute_s`` and ``wait_s``. CUDA: those of
        the newest earlier step the GPU has finished, or None (never waits)."""
        if not self.cuda:
            out = summarize(self._totals, self._wait)
            self.discard()
            return out
        if self._open:
            self._pending.append(self._open)
            self._open = []
        latest = None
        while self._pending and self._pending[0][-1][3].query():
            totals: dict[str, float] = {}
            wait: set[str] = set()
            for name, compute, start, end in self._pending.popleft():
                totals[name] = totals.get(name, 0.0) + start.elapsed_time(end) / 1e3
                if not compute:
                    wait.add(name)
            latest = summarize(totals, wait)
        return latest

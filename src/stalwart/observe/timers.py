"""Section timers for the training step: where a step's time goes, at ~1 µs per section.

    timer = SectionTimer(device)
    with timer.section("forward"): ...
    with timer.section("comm_wait", compute=False): ...
    sections = timer.step_done()   # {"forward": 0.012, ..., "compute_s": ..., "wait_s": ...}

On CUDA, sections are timed with events on the current stream and resolved at `step_done()` (one
synchronize per step, which the optimizer step already implies); on CPU with perf_counter.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class SectionTimer:
    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self._open: list[tuple[str, bool, object, object]] = []
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

    def step_done(self) -> dict[str, float]:
        """This step's seconds per section plus `compute_s` and `wait_s`; resets for the next step."""
        if self._open:
            torch.cuda.synchronize()
            for name, compute, start, end in self._open:
                self._add(name, compute, start.elapsed_time(end) / 1e3)  # type: ignore[attr-defined]
            self._open.clear()
        out = dict(self._totals)
        out["compute_s"] = sum(v for k, v in self._totals.items() if k not in self._wait)
        out["wait_s"] = sum(v for k, v in self._totals.items() if k in self._wait)
        self._totals.clear()
        self._wait.clear()
        return out

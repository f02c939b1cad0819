"""A process start split into phases, so a restart's seconds can be read where they go (on a GPU the
CUDA context, NCCL's communicator and host → device copies add to what the CPU shows)."""

from __future__ import annotations

import time

import psutil


class Phases:
    """Consecutive wall-clock intervals: each `mark(name)` closes the interval since the previous one.
    The first, `process`, runs from the process's creation (a zygote's fork, or a cold start with its
    imports) to this object's creation."""

    def __init__(self) -> None:
        now = time.time()
        self._last = now
        self.seconds: dict[str, float] = {"process": round(max(0.0, now - psutil.Process().create_time()), 4)}

    def mark(self, name: str) -> None:
        now = time.time()
        self.seconds[name] = round(now - self._last, 4)
        self._last = now

"""A process start split into phases, so a restart's seconds can be read where they go (on a GPU the
CUDA context, NCCL's communicator and host → device copies add to what the CPU shows)."""

from __future__ import annotations

import os
import time

import psutil


def process_age_s() -> float:
    """Seconds since this process was created. On Linux from its start tick and the boot clock (10 ms
    resolution); psutil's create_time adds the boot time, which /proc/stat gives in whole seconds, so it
    can be off by up to a second (CI: a restart's phases summed to more than its kill → first step)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command's ")"
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return max(0.0, time.time() - psutil.Process().create_time())


class Phases:
    """Consecutive wall-clock intervals: each `mark(name)` closes the interval since the previous one.
    The first, `process`, runs from the process's creation (a zygote's fork, or a cold start with its
    imports) to this object's creation."""

    def __init__(self) -> None:
        self._last = time.time()
        self.seconds: dict[str, float] = {"process": round(process_age_s(), 4)}

    def mark(self, name: str) -> None:
        now = time.time()
        self.seconds[name] = round(now - self._last, 4)
        self._last = now

"""When is a silent worker hung? A timeout that follows what the worker says it is doing.

Peers fire falsely on first steps and eval phases (DLRover PRs #1727, #1730). Here the allowance is:
  - before `warmup_steps` steps have completed: `startup_s` (imports, compile, first collectives);
  - in a "checkpoint" or "eval" phase: `phase_s`;
  - otherwise: the user's timeout, or auto = max(floor_s, k × median step time).
The auto defaults (9 s, 2.7×) sit just under the promise "a hang is detected within max(10 s, 3 × step
time)": detection also waits for the agent's next monitor tick, so an allowance of exactly 10 s would
be reported at 10.0x s.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from stalwart.launch.progress import Progress


@dataclass
class HangPolicy:
    timeout_s: float | None = None  # None = auto
    floor_s: float = 9.0
    k: float = 2.7
    startup_s: float = 120.0
    warmup_steps: int = 2
    phase_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("floor_s", "k", "startup_s", "phase_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"hang policy {name} must be positive, got {getattr(self, name)}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"--hang-timeout must be positive, got {self.timeout_s}")


@dataclass
class HangDetector:
    """Feed it every rank's latest progress; it learns step times and says which ranks are hung."""

    policy: HangPolicy = field(default_factory=HangPolicy)
    window: int = 50
    _last: dict[int, tuple[int, float]] = field(default_factory=dict)
    _durations: deque = field(default_factory=lambda: deque(maxlen=50))

    def median_step_s(self) -> float | None:
        return statistics.median(self._durations) if self._durations else None

    def allowance(self, progress: Progress) -> float:
        p = self.policy
        if progress.reports < p.warmup_steps:
            return p.startup_s
        if progress.phase in ("checkpoint", "eval"):
            return p.phase_s
        if p.timeout_s is not None:
            return p.timeout_s
        median = self.median_step_s()
        return max(p.floor_s, p.k * median) if median else p.floor_s

    def observe(self, progress: Progress) -> None:
        last = self._last.get(progress.rank)
        if last and progress.step > last[0] and progress.reports > self.policy.warmup_steps:
            self._durations.append((progress.time - last[1]) / (progress.step - last[0]))
        if not last or progress.step != last[0]:
            self._last[progress.rank] = (progress.step, progress.time)

    def hung(self, progresses: list[Progress], now: float) -> list[tuple[int, float, float]]:
        """(rank, silent seconds, allowance) for every rank silent longer than its allowance."""
        out = []
        for progress in progresses:
            self.observe(progress)
            allowance = self.allowance(progress)
            silent = now - progress.time
            if progress.phase not in ("done", "returned") and silent > allowance:
                out.append((progress.rank, silent, allowance))
        return out

    def reset(self) -> None:
        """After a restart: positions start over, learned step times stay valid."""
        self._last.clear()

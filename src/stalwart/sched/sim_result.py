"""What one cluster-simulator run produced (``stalwart sim``): per-job outcomes and the summary every
policy is compared on. Shared by the ElasticFlow-trace and the Pollux-workload simulators so their
results print, plot and serialise the same way."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Called as progress(done, total) while a simulation runs (e.g. jobs finished of jobs submitted).
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class JobOutcome:
    """One job's fate. ``finish`` is None for a job that never completed (dropped at admission, or the
    simulation ended first); ``deadline`` is absolute (same clock as ``submit``), None without one."""

    name: str
    submit: float
    finish: float | None
    deadline: float | None = None
    gpu_seconds: float = 0.0

    @property
    def jct(self) -> float | None:
        return None if self.finish is None else self.finish - self.submit

    @property
    def met_deadline(self) -> bool:
        return self.deadline is not None and self.finish is not None and self.finish <= self.deadline + 1e-6


@dataclass
class SimResult:
    """A policy's run over one trace or workload."""

    trace: str
    policy: str
    gpus: int
    jobs: list[JobOutcome]
    reallocations: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Average/p99 JCT over finished jobs (s), makespan (s), deadline satisfaction ratio over jobs
        with a deadline (None when none has one), GPU-hours, reallocations."""
        jcts = sorted(j.jct for j in self.jobs if j.jct is not None)
        with_deadline = [j for j in self.jobs if j.deadline is not None]
        finished = [j.finish for j in self.jobs if j.finish is not None]
        out: dict[str, Any] = {
            "trace": self.trace,
            "policy": self.policy,
            "gpus": self.gpus,
            "jobs": len(self.jobs),
            "finished": len(jcts),
            "avg_jct_s": sum(jcts) / len(jcts) if jcts else None,
            "p99_jct_s": _percentile(jcts, 0.99) if jcts else None,
            "makespan_s": (max(finished) - min(j.submit for j in self.jobs)) if finished else None,
            "dsr": (sum(j.met_deadline for j in with_deadline) / len(with_deadline)) if with_deadline else None,
            "gpu_hours": sum(j.gpu_seconds for j in self.jobs) / 3600.0,
            "reallocations": self.reallocations,
        }
        out.update({k: v for k, v in self.extra.items() if v is None or isinstance(v, (bool, int, float, str))})
        return out  # per-job extras (dicts, lists) stay in ``extra``: a summary is one line per run


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]

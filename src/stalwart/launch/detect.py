"""Detect: what the agent's monitor tick sees, turned into incidents. Pure functions, no processes.

Input is what the agent gathered (``evidence``): every local rank's progress record, TorchElastic's run
result (failed ranks with exit codes), the tail of each failed rank's log, when chaos injected a fault
(``fault_time``), the clock.
Output is an ``Incident`` (or None); what to do about it is ``decide``'s, doing it is the agent's.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from stalwart.health.log_rules import NEVER, Diagnosis, diagnose, last_traceback
from stalwart.health.throttle import Throttle
from stalwart.launch.hang import HangDetector
from stalwart.launch.progress import Progress

# A rank killed or cut off because another one died: a consequence, not the cause.
CONSEQUENTIAL = ("connection", "collective_timeout", "sigterm")


@dataclass
class Incident:
    """One fault being handled; times are wall-clock seconds."""

    kind: str
    cls: str
    retry: bool
    detected: float
    fault: float | None = None
    ranks: list[int] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    id: int | None = None
    last_step: int = -1


class Failure(Protocol):
    """What detection needs of TorchElastic's ``ProcessFailure``."""

    exitcode: int
    timestamp: int
    message: Any


def progress_of(records: dict[int, Progress | None], started_at: float) -> list[Progress]:
    """Every rank's progress, in rank order. A rank with no record yet is still starting: it counts from
    the group's start. So does a record file that exists but was never written (zero-filled: time 0,
    i.e. 1970 — which read as 55 years of silence once, a false hang at start-up)."""
    out = []
    for rank, p in records.items():
        if p is None or p.time <= 0:
            p = Progress(rank, -1, started_at, "init", float("nan"), 0)
        out.append(p)
    return out


def with_last_step(incident: Incident, progress: list[Progress]) -> Incident:
    incident.last_step = max((p.step for p in progress), default=-1)
    incident.details.update(last_step=incident.last_step, ranks=incident.ranks)
    return incident


def unheld(progress: list[Progress], throttle: Throttle | None) -> list[Progress]:
    """For the hang detector: the time a throttle held the workers since a report is not their silence."""
    if throttle is None:
        return progress
    return [replace(p, time=p.time + throttle.stopped_since(p.time)) for p in progress]


def hang(
    detector: HangDetector, progress: list[Progress], now: float, fault_time: Callable[[int], float | None]
) -> Incident | None:
    """A hang incident if any rank is silent past its allowance (the detector also learns step times
    from ``progress``, so call it once per tick). The fault time is the silent ranks' last report, or
    the time chaos injected the fault when it did (exact MTTR figures)."""
    hung = detector.hung(progress, now)
    if not hung:
        return None
    ranks = [rank for rank, _, _ in hung]
    fault = min(p.time for p in progress if p.rank in ranks)
    fault = min([fault_time(r) or fault for r in ranks])
    incident = Incident(
        "hang",
        "system",
        True,
        now,
        fault,
        ranks,
        {"silent_s": {r: s for r, s, _ in hung}, "allowance_s": {r: a for r, _, a in hung}},
    )
    return with_last_step(incident, progress)


def diagnose_failure(failure: Failure, log_tail: str) -> Diagnosis:
    """A failed rank's diagnosis: its death signal, else the log rules, else its exit code."""
    if failure.exitcode < 0:
        name = signal.Signals(-failure.exitcode).name
        return Diagnosis(name.lower(), "system", NEVER, f"killed by {name}")
    return diagnose(log_tail) or Diagnosis("exit", "system", NEVER, f"exit code {failure.exitcode}")


def worker_exit(
    failures: dict[int, Failure],
    logs: dict[int, str],
    progress: list[Progress],
    progressed: bool,
    now: float,
    fault_time: Callable[[int], float | None],
) -> Incident:
    """The incident for failed workers: the failure that is a cause (peers of a dead rank fail with
    connection errors, the agent's SIGTERM to the survivors is a consequence too), earliest first.
    ``progressed``: any step completed in an earlier attempt (user-error rules need it)."""
    assert failures, "worker_exit needs at least one failed rank"
    candidates = []
    for rank, failure in failures.items():
        text = logs.get(rank, "")
        diagnosis = diagnose_failure(failure, text)
        candidates.append((diagnosis.kind in CONSEQUENTIAL, failure.timestamp, rank, failure, diagnosis, text))
    consequential, _, rank, failure, diagnosis, text = min(candidates, key=lambda c: c[:3])
    traceback = failure.message if "Traceback" in str(failure.message or "") else last_traceback(text)
    retry = diagnosis.retry(progressed or any(p.reports > 0 for p in progress))
    incident = Incident(
        diagnosis.kind,
        diagnosis.cls,
        retry,
        now,
        fault_time(rank),
        [rank],
        {
            "exitcode": failure.exitcode,
            "evidence": diagnosis.evidence,
            "traceback": traceback,
            "consequential": consequential,
        },
    )
    return with_last_step(incident, progress)


def first_step(progress: list[Progress]) -> float | None:
    """When every rank has reported a step since the (re)start: the time of the last of them."""
    if not progress or any(p.reports == 0 for p in progress):
        return None
    return max(p.time for p in progress)


@dataclass(frozen=True)
class WorkerReport:
    """An incident a worker recorded itself (``stalwart.incident``), as the master journals it."""

    kind: str
    cls: str | None
    times: dict[str, float]
    details: dict[str, Any]
    evict_reason: str | None  # an ``sdc`` with ``evict``: the decision to journal, naming this node


def worker_report(record: dict[str, Any], node_id: str, now: float) -> WorkerReport:
    """One line of ``rank*.incidents.jsonl`` (a dict with a string ``kind``) for the journal."""
    kind, detail = record["kind"], record.get("detail") or {}
    if not isinstance(detail, dict):
        detail = {"detail": detail}
    details = {**detail, "rank": record.get("rank"), "step": record.get("step"), "source": "worker"}
    times = {"detected": now}
    if isinstance(record.get("time"), (int, float)):
        times["fault"] = float(record["time"])
    evict = None
    if kind == "sdc" and detail.get("evict"):
        evict = f"silent data corruption on rank {record.get('rank')} (node {node_id}) at step {record.get('step')}"
    return WorkerReport(kind, record.get("class"), times, details, evict)

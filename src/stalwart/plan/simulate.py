"""Discrete-event simulation of one long training job under failures: how much of the wall clock
advances training (ETTR) for a failure model (:mod:`stalwart.plan.failures`) and a recovery policy.

Why simulate when :mod:`stalwart.plan.reliability` has closed forms: the closed forms take one
failure rate and one restart cost, while a policy's cost depends on *what* failed (a lost node takes
its memory snapshots with it; a hang waits for a timeout), on spares running out, and on failures
during a recovery. The simulation keeps all of that and agrees with Daly's formula where both apply.

Model. Failures of each class arrive as a Poisson process in wall time. While the job runs, its work
position advances at ``1 / (1 + stall fractions)`` (storage checkpoints every ``storage_every_s`` of
work stalling ``storage_stall_s``; memory snapshots likewise). A storage checkpoint is durable
``persist_s`` after it was taken (async writes). On a failure the job resumes from the newest state
that survived: a memory snapshot (the node survived), a peer's copy of it (``replicas``), else the
last durable storage checkpoint; it is down for detection + node replacement (node-evicting failures:
a spare joins; with no spare left, the job waits for a repaired node) + restart + restore. A failure
during a recovery starts the recovery over. ETTR = work position at the end ÷ wall time.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

from stalwart.plan.failures import GPUS_PER_NODE, FailureClass


@dataclass(frozen=True)
class RecoveryPolicy:
    """How a job checkpoints and recovers; costs in seconds."""

    name: str
    storage_every_s: float  # work between storage checkpoints
    storage_stall_s: float  # training stalled per storage checkpoint
    persist_s: float = 0.0  # a storage checkpoint is durable this long after it was taken
    snapshot_every_s: float = 0.0  # work between memory snapshots (0: none)
    snapshot_stall_s: float = 0.0
    replicas: int = 0  # peer copies of each node's snapshot: a lost node's state survives
    replicate_s: float = 0.0  # a snapshot's peer copy is complete this long after it was taken
    detect_s: float = 60.0  # a crash is noticed
    hang_detect_s: float = 600.0  # a hang is noticed (collective timeout)
    restart_s: float = 300.0  # stop, rendezvous, communicator init
    replace_node_s: float = 300.0  # a spare node joins the job
    restore_storage_s: float = 120.0
    restore_memory_s: float = 5.0
    restore_peer_s: float = 10.0

    def __post_init__(self) -> None:
        if self.storage_every_s <= 0:
            raise ValueError(f"policy {self.name!r}: storage_every_s must be positive")
        for key, value in asdict(self).items():
            if isinstance(value, float | int) and value < 0:
                raise ValueError(f"policy {self.name!r}: {key} must be >= 0, got {value}")

    @property
    def slowdown(self) -> float:
        """Wall seconds per second of work while running (checkpoint stalls)."""
        snap = self.snapshot_stall_s / self.snapshot_every_s if self.snapshot_every_s else 0.0
        return 1 + self.storage_stall_s / self.storage_every_s + snap


@dataclass(frozen=True)
class Job:
    gpus: int
    days: float  # wall-clock days simulated
    gpus_per_node: int = GPUS_PER_NODE
    spares: int | None = None  # spare nodes; None: a spare is always there
    repair_hours: float = 24.0  # a failed node returns to the spare pool

    def __post_init__(self) -> None:
        if self.gpus <= 0 or self.days <= 0 or self.gpus_per_node <= 0:
            raise ValueError("a job needs positive gpus, days and gpus_per_node")
        if self.spares is not None and self.spares < 0:
            raise ValueError(f"spares must be >= 0 (or None for always one), got {self.spares}")


class _Spares:
    """The spare-node pool: a lost node goes to repair and comes back ``repair_s`` later."""

    def __init__(self, count: int | None, repair_s: float) -> None:
        self.free, self.repair_s = count, repair_s
        self.back: list[float] = []

    def take(self, t: float) -> float:
        """A spare for a node lost at ``t``: returns how long the job waits for one."""
        if self.free is None:
            return 0.0
        while self.back and self.back[0] <= t:
            heapq.heappop(self.back)
            self.free += 1
        wait = 0.0
        if self.free > 0:
            self.free -= 1
        else:  # none left: the first node back from repair joins
            wait = heapq.heappop(self.back) - t
        heapq.heappush(self.back, t + self.repair_s)
        return wait


def _floor_to(x: float, every: float) -> float:
    return math.floor(max(x, 0.0) / every + 1e-9) * every


def simulate(job: Job, classes: list[FailureClass], policy: RecoveryPolicy, seed: int = 0) -> dict[str, Any]:
    """One run of ``job`` for ``job.days``; deterministic for a seed."""
    rng = random.Random(seed)
    rates = [c.job_rate(job.gpus, job.gpus_per_node) / 3600 for c in classes]
    total = sum(rates)
    horizon = job.days * 86400
    slow, p = policy.slowdown, policy
    spares = _Spares(job.spares, job.repair_hours * 3600)
    counts = dict.fromkeys((c.name for c in classes), 0)
    lost = down = waited = 0.0
    t, pos, durable = 0.0, 0.0, 0.0  # wall time, work position at the run's start, last durable checkpoint
    next_fail = rng.expovariate(total) if total > 0 else math.inf

    def pick() -> FailureClass:
        return classes[rng.choices(range(len(classes)), weights=rates)[0]]

    while True:
        if next_fail >= horizon:
            pos += (horizon - t) / slow
            break
        tf = first = next_fail
        work = pos + (tf - t) / slow
        durable = max(durable, min(work, _floor_to(work - p.persist_s / slow, p.storage_every_s)))
        snap = _floor_to(work, p.snapshot_every_s) if p.snapshot_every_s else -1.0
        peer = _floor_to(work - p.replicate_s / slow, p.snapshot_every_s) if p.snapshot_every_s and p.replicas else -1.0
        resume, restore = durable, p.restore_storage_s
        end = tf
        while True:  # a recovery, started over by each failure that interrupts it
            cls = pick()
            counts[cls.name] += 1
            if not cls.evicts_node and snap > resume:
                resume, restore = snap, p.restore_memory_s
            elif cls.evicts_node and snap >= 0:
                snap = peer  # this node's snapshots are gone; a peer's copy may survive
                if peer > durable:
                    resume, restore = peer, p.restore_peer_s
                else:
                    resume, restore = durable, p.restore_storage_s
            wait = spares.take(tf) if cls.evicts_node else 0.0
            waited += wait
            end = tf + (p.hang_detect_s if cls.hang else p.detect_s) + restore + p.restart_s
            end += (p.replace_node_s + wait) if cls.evicts_node else 0.0
            next_fail = tf + (rng.expovariate(total) if total > 0 else math.inf)
            if next_fail >= min(end, horizon):
                break
            tf = next_fail
        lost += work - resume
        down += min(end, horizon) - first
        pos, t = resume, min(end, horizon)
        if end >= horizon:
            break
    failures = sum(counts.values())
    return {
        "ettr": pos / horizon,
        "failures": failures,
        "by_class": counts,
        "mttf_hours": horizon / 3600 / failures if failures else None,
        "lost_work_hours": lost / 3600,
        "downtime_hours": down / 3600,
        "waited_for_spares_hours": waited / 3600,
    }


def run(job: Job, classes: list[FailureClass], policy: RecoveryPolicy, runs: int = 20, seed: int = 0) -> dict[str, Any]:
    """``runs`` independent runs (seeds ``seed``..``seed+runs-1``): mean and spread."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    results = [simulate(job, classes, policy, seed + i) for i in range(runs)]
    ettrs = sorted(r["ettr"] for r in results)
    failures = [r["failures"] for r in results]
    return {
        "policy": policy.name,
        "gpus": job.gpus,
        "days": job.days,
        "runs": runs,
        "ettr": statistics.fmean(ettrs),
        "ettr_p5": ettrs[int(0.05 * (runs - 1))],
        "ettr_p95": ettrs[math.ceil(0.95 * (runs - 1))],
        "failures": statistics.fmean(failures),
        "mttf_hours": job.days * 24 / statistics.fmean(failures) if sum(failures) else None,
        "lost_work_hours": statistics.fmean(r["lost_work_hours"] for r in results),
        "downtime_hours": statistics.fmean(r["downtime_hours"] for r in results),
        "waited_for_spares_hours": statistics.fmean(r["waited_for_spares_hours"] for r in results),
        "by_class": {c: statistics.fmean(r["by_class"][c] for r in results) for c in results[0]["by_class"]},
    }


def with_costs(policy: RecoveryPolicy, **costs: float) -> RecoveryPolicy:
    return replace(policy, **costs)

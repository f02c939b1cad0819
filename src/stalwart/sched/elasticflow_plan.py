"""ElasticFlow's admission planner, reimplemented: each job in deadline order reserves its *minimum
satisfactory share* in a piecewise-constant profile of future free GPUs. A job is admitted only if the
plan of every admitted job (and it) still meets its deadline; this is what lets ElasticFlow drop
hopeless jobs up front instead of letting them eat GPUs and miss anyway."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stalwart.sched.elasticflow_trace import Scaling

_EPS = 1e-9


class Profile:
    """Free GPUs over time: segment ``i`` is ``[t[i], t[i+1])`` with ``free[i]`` GPUs; the last one is
    open-ended (everything planned has ended by then). With ``slot`` > 0 a reservation holds its GPUs
    until the next multiple of ``slot`` after ``now`` (ElasticFlow plans on its scheduling-slot grid,
    so a job finishing mid-slot keeps its GPUs to the slot's end in the plan)."""

    def __init__(self, now: float, gpus: int, slot: float = 0.0) -> None:
        self.t = np.array([now], dtype=np.float64)
        self.free = np.array([gpus], dtype=np.int64)
        self.slot = slot

    def hold(self, finish: float) -> float:
        """Until when a reservation that finishes at ``finish`` keeps its GPUs."""
        if self.slot <= 0:
            return finish
        now = float(self.t[0])
        return now + math.ceil((finish - now) / self.slot - 1e-9) * self.slot

    def split(self, x: float) -> int:
        """Make ``x`` a breakpoint; return its index (``len`` never, since x > now)."""
        i = int(np.searchsorted(self.t, x))
        if i < len(self.t) and self.t[i] == x:
            return i
        self.t = np.insert(self.t, i, x)
        self.free = np.insert(self.free, i, self.free[i - 1])
        return i


@dataclass
class Plan:
    """A job's reservation: ``alloc_now`` GPUs from now, ``finish`` its planned end, ``change`` the first
    later time its planned allocation differs (a reason to reschedule then; inf if none)."""

    feasible: bool
    alloc_now: int
    finish: float
    change: float


def plan_job(prof: Profile, sc: Scaling, iters: float, deadline: float, *, margin: float = 0.0) -> Plan | None:
    """Reserve the minimum satisfactory share for ``iters`` iterations by ``deadline - margin``.

    Tries levels from the smallest: the first level ``q`` whose allocation (capped by what is free in
    each segment) finishes in time wins; the job runs one level lower (``p``) early and at ``q`` only in
    the latest stretch that ``q`` alone needs, as ElasticFlow does, so it leaves more room to others.
    Returns None (reserving nothing) if no level meets the deadline."""
    now = float(prof.t[0])
    due = deadline - margin
    if due <= now or iters <= 0:
        return None if iters > 0 else Plan(True, 0, now, np.inf)
    d = prof.split(due)
    dur = np.diff(prof.t[: d + 1])
    cap = sc.down[prof.free[:d]]
    alloc = np.minimum(cap[None, :], sc.levels[:, None])  # levels x segments
    work = sc.rate[alloc] * dur
    total = work.sum(axis=1)
    ok = np.nonzero(total >= iters * (1 - _EPS))[0]
    if len(ok) == 0:
        return None
    q = int(ok[0])
    suffix = np.cumsum(work[q][::-1])[::-1]
    point = int(np.nonzero(suffix >= iters * (1 - _EPS))[0][-1])
    seg_alloc = alloc[q].copy()
    seg_work = work[q].copy()
    if q > 0:
        seg_alloc[:point] = alloc[q - 1][:point]
        seg_work[:point] = work[q - 1][:point]
    return _reserve(prof, sc, seg_alloc, seg_work, iters, feasible=True)


def plan_late(prof: Profile, sc: Scaling, iters: float) -> Plan:
    """Plan a job that can no longer meet its deadline: as many GPUs as free (up to its cap) until done,
    so it gets out of the way soonest (ElasticFlow keeps such admitted jobs running)."""
    dur = np.append(np.diff(prof.t), np.inf)
    seg_alloc = np.minimum(sc.down[prof.free], sc.max_level)
    with np.errstate(invalid="ignore"):
        seg_work = np.where(seg_alloc > 0, sc.rate[seg_alloc] * dur, 0.0)
    return _reserve(prof, sc, seg_alloc, seg_work, iters, feasible=False)


def _reserve(
    prof: Profile, sc: Scaling, seg_alloc: np.ndarray, seg_work: np.ndarray, iters: float, *, feasible: bool
) -> Plan:
    """Walk the chosen allocation forward to where ``iters`` are done and take those GPUs off ``prof``."""
    done = np.cumsum(seg_work)
    f = int(np.searchsorted(done, iters * (1 - _EPS)))
    f = min(f, len(seg_alloc) - 1)
    before = float(done[f - 1]) if f > 0 else 0.0
    rate = float(sc.rate[seg_alloc[f]])
    finish = float(prof.t[f]) + max(0.0, iters - before) / rate
    end = prof.split(prof.hold(finish))
    prof.free[:f] -= seg_alloc[:f]
    # the last level runs to the finish (and, on a slot grid, on to the hold time)
    prof.free[f:end] -= np.minimum(seg_alloc[f], prof.free[f:end])
    first = int(seg_alloc[0])
    diff = np.nonzero(seg_alloc[: f + 1] != first)[0]
    change = float(prof.t[diff[0]]) if len(diff) else math.inf
    return Plan(feasible, first, finish, change)

"""Scheduling policies for the ElasticFlow-trace simulator (elasticflow_sim). Each decides, once per
round, how many GPUs every active job holds, and what that round costs each job in overhead.

The baselines follow the semantics of ElasticFlow's published simulator (read, then reimplemented):
``elasticflow`` (ef-accessctrl: deadline admission + minimum satisfactory shares, idle GPUs handed
out, a few seconds of scaling overhead every round), ``edf`` (deadline order, every job at its largest
useful size, preemptive, no admission), ``tiresias`` (dlas-gpu: trace GPU counts and durations,
discretised least-attained GPU-service queues) and ``fifo``. ``stalwart`` is ours: the same admission,
but it pays a restart cost only when a job's allocation actually changes, keeps allocations stable
when it can, and hands idle GPUs out by marginal goodput."""

from __future__ import annotations

import heapq
import math
from pathlib import Path

from stalwart.sched.elasticflow_place import GPUS_PER_NODE, Placement, switches_for
from stalwart.sched.elasticflow_plan import Profile, plan_job, plan_late
from stalwart.sched.elasticflow_trace import Scaling, TraceJob, elastic_cap, fixed_cap, scaling

RESTART_EVERY = 60  # ElasticFlow's simulator restarts all trainers every 60 rounds
TIRESIAS_LIMITS = (3250.0, 7200.0)  # GPU-seconds of attained service to leave queue 0, queue 1


class SimJob:
    """Mutable per-job state of one simulation run."""

    __slots__ = (
        "admitted",
        "alloc",
        "attained",
        "dropped",
        "eta",
        "finish",
        "fixed_rate",
        "gpu_seconds",
        "idx",
        "left",
        "overhead",
        "queue",
        "real_end",
        "reallocations",
        "row",
        "sc",
        "started",
    )  # fmt: skip

    def __init__(self, idx: int, row: TraceJob) -> None:
        self.idx, self.row = idx, row
        self.left = row.iterations
        self.alloc = 0
        self.overhead = 0.0
        self.eta = self.real_end = math.inf
        self.finish: float | None = None
        self.dropped = self.admitted = self.started = False
        self.gpu_seconds = self.attained = 0.0
        self.reallocations = self.queue = 0
        self.sc: Scaling | None = None
        self.fixed_rate = 0.0


class Policy:
    """Base: subclasses set allocations (``job.alloc``) and overheads in ``schedule``. ``event_ends``
    selects ElasticFlow's completion accounting (see elasticflow_sim)."""

    event_ends = False

    def __init__(self, gpus: int, data_root: Path, restart_cost_s: float) -> None:
        self.gpus, self.data_root, self.restart_cost_s = gpus, data_root, restart_cost_s
        self.big = gpus >= 256  # ElasticFlow's overhead model is larger on big clusters

    def prepare(self, job: SimJob) -> None:
        row = job.row
        job.sc = scaling(self.data_root, row.model, row.batch_size, self.cap(row), self.gpus)
        if row.num_gpu > self.gpus:
            raise ValueError(f"job {row.name} asks for {row.num_gpu} GPUs, more than the cluster's {self.gpus}")
        dur = row.duration if row.duration > 0 else row.iterations / float(job.sc.rate[min(row.num_gpu, self.gpus)])
        job.fixed_rate = row.iterations / max(dur, 1e-9)

    def cap(self, row: TraceJob) -> int:
        return fixed_cap(row.batch_size)

    def rate(self, job: SimJob, alloc: int) -> float:
        assert job.sc is not None
        return float(job.sc.rate[alloc])

    def schedule(self, t: float, new: list[SimJob], active: list[SimJob], rnd: int) -> float:
        """Set ``alloc`` and ``overhead`` of ``new + active`` (mark refused ones ``dropped``); return the
        next time this policy wants a round even if nothing arrives or ends (inf if none)."""
        raise NotImplementedError

    def ef_overhead(self, job: SimJob, miss: bool, rnd: int) -> float:
        """ElasticFlow's simulated per-round scaling overhead (utils.estimate_overhead) for a running
        job: a fixed cost, plus 2 s * (log2(GPUs) + 1) when its rank range is not in the communicator
        cache (see elasticflow_place), plus a trainer restart when that miss falls on a restart round
        (every ``RESTART_EVERY`` rounds; the cache is emptied right after)."""
        cost = 7.0 if self.big else 2.0
        if miss:
            cost += (math.log2(job.alloc) + 1) * 2
            if rnd > 0 and rnd % RESTART_EVERY == 0:
                cost += 47.0 if self.big else 27.0
        return cost

    def _set(self, job: SimJob, alloc: int) -> bool:
        """Apply an allocation; count a reallocation when a started job's GPU count changes."""
        changed = alloc != job.alloc
        if changed and job.started:
            job.reallocations += 1
        job.alloc = alloc
        job.started = job.started or alloc > 0
        return changed


class ElasticFlow(Policy):
    """ef-accessctrl. A batch of arrivals is admitted only if re-planning every admitted job plus the
    batch in deadline order keeps all of them on time; otherwise the whole batch is declined."""

    per_job_admission = False
    margin_restarts = 0.0
    plan_slot = 60.0  # ElasticFlow's planning grid (its scheduling slot)
    event_ends = True

    def __init__(self, gpus: int, data_root: Path, restart_cost_s: float) -> None:
        super().__init__(gpus, data_root, restart_cost_s)
        self.placement = Placement(gpus, switches_for(gpus)) if gpus % GPUS_PER_NODE == 0 else None

    def cap(self, row: TraceJob) -> int:
        return elastic_cap(row.model, row.batch_size)

    def schedule(self, t: float, new: list[SimJob], active: list[SimJob], rnd: int) -> float:
        admitted = [j for j in active if j.admitted]
        if self.per_job_admission:
            plans = self._plan(t, admitted)
            for job in sorted(new, key=lambda j: (j.row.deadline, j.idx)):
                trial = self._plan(t, [*admitted, job], only_feasible=True)
                if trial is None:
                    job.dropped = True
                else:
                    job.admitted, plans = True, trial
                    admitted.append(job)
        else:
            plans = self._plan(t, admitted + new, only_feasible=True) if new else None
            if plans is None:
                for job in new:
                    job.dropped = True
                plans = self._plan(t, admitted)
            else:
                for job in new:
                    job.admitted = True
                admitted += new
        assert plans is not None
        allocs, free, wake = plans
        self._fill(admitted, allocs, free)
        changed = {job.idx: self._set(job, allocs[job.idx]) for job in admitted}
        misses = self._misses(admitted, changed, rnd)
        for job in admitted:
            job.overhead = self._overhead(job, misses[job.idx], rnd) if job.alloc > 0 else 0.0
        return wake

    def _misses(self, admitted: list[SimJob], changed: dict[int, bool], rnd: int) -> dict[int, bool]:
        """Which running jobs miss ElasticFlow's communicator cache this round: re-place the cluster
        (release in deadline order, place by GPU count, largest first, ties in deadline order)."""
        if self.placement is None:  # not whole nodes: fall back to misses on reallocation
            return changed
        by_ddl = sorted(admitted, key=lambda j: (j.row.deadline, j.idx))
        order = sorted((j for j in by_ddl if j.alloc > 0), key=lambda j: -j.alloc)
        hits = self.placement.round([j.idx for j in by_ddl], [(j.idx, j.alloc) for j in order])
        if rnd > 0 and rnd % RESTART_EVERY == 0:
            self.placement.restart()
        return {j.idx: not hits.get(j.idx, True) for j in admitted}

    def _plan(
        self, t: float, jobs: list[SimJob], *, only_feasible: bool = False
    ) -> tuple[dict[int, int], int, float] | None:
        """Plan ``jobs`` in deadline order from an empty cluster at ``t``: their GPUs now, the GPUs
        left free now, and the first time a plan changes. None if ``only_feasible`` and one is late."""
        prof = Profile(t, self.gpus, self.plan_slot)
        allocs: dict[int, int] = {}
        wake = math.inf
        late: list[SimJob] = []
        margin = self.margin_restarts * self.restart_cost_s
        for job in sorted(jobs, key=lambda j: (j.row.deadline, j.idx)):
            assert job.sc is not None
            plan = plan_job(prof, job.sc, job.left, job.row.deadline, margin=margin)
            if plan is None:
                if only_feasible and (not job.admitted or not self.per_job_admission):
                    return None
                late.append(job)
                continue
            allocs[job.idx] = plan.alloc_now
            wake = min(wake, plan.change)
        for job in late:  # hopeless but admitted: run on what is left, soonest-deadline first
            assert job.sc is not None
            plan = plan_late(prof, job.sc, job.left)
            allocs[job.idx] = plan.alloc_now
            wake = min(wake, plan.change)
        return allocs, int(prof.free[0]), wake

    def _fill(self, jobs: list[SimJob], allocs: dict[int, int], free: int) -> None:
        """Hand idle GPUs out, first to jobs planned to wait, then by throughput gained per GPU."""
        heap: list[tuple[float, int, SimJob]] = []
        for job in jobs:
            self._push(heap, job, allocs[job.idx])
        while heap and free > 0:
            _, _, job = heapq.heappop(heap)
            cur = allocs[job.idx]
            nxt = self._next_level(job, cur)
            if nxt - cur > free:
                continue
            allocs[job.idx] = nxt
            free -= nxt - cur
            self._push(heap, job, nxt)

    def _push(self, heap: list[tuple[float, int, SimJob]], job: SimJob, cur: int) -> None:
        nxt = self._next_level(job, cur)
        if nxt > cur:
            heapq.heappush(heap, (-self._gain(job, cur, nxt), job.idx, job))

    def _gain(self, job: SimJob, cur: int, nxt: int) -> float:
        if cur == 0:
            return math.inf
        return (self.rate(job, nxt) / self.rate(job, cur) - 1.0) / (nxt - cur)

    @staticmethod
    def _next_level(job: SimJob, cur: int) -> int:
        assert job.sc is not None
        for g in job.sc.levels:
            if g > cur:
                return int(g)
        return cur

    def _overhead(self, job: SimJob, miss: bool, rnd: int) -> float:
        return self.ef_overhead(job, miss, rnd)


class Stalwart(ElasticFlow):
    """Deadline admission per job (a late admitted job never blocks newcomers), a restart cost only
    on real reallocations, a planning margin of a few restarts, stable allocations preferred, idle
    GPUs by marginal goodput (iterations/s gained per GPU, relative to the work left)."""

    per_job_admission = True
    margin_restarts = 2.0
    plan_slot = 0.0
    event_ends = False

    def _fill(self, jobs: list[SimJob], allocs: dict[int, int], free: int) -> None:
        for job in sorted(jobs, key=lambda j: (j.row.deadline, j.idx)):  # keep what it had if possible
            extra = job.alloc - allocs[job.idx]
            if 0 < extra <= free:
                allocs[job.idx] = job.alloc
                free -= extra
        super()._fill(jobs, allocs, free)

    def _gain(self, job: SimJob, cur: int, nxt: int) -> float:
        if cur == 0:
            return math.inf
        return (self.rate(job, nxt) - self.rate(job, cur)) / (nxt - cur) / max(job.left, 1.0)

    def _misses(self, admitted: list[SimJob], changed: dict[int, bool], rnd: int) -> dict[int, bool]:
        return changed  # we pay our restart cost exactly when a job's allocation changes

    def _overhead(self, job: SimJob, miss: bool, rnd: int) -> float:
        return self.restart_cost_s if miss else 0.0


class EDF(Policy):
    """Earliest deadline first, preemptive, no admission: each job in deadline order takes its largest
    useful size, or the largest level that still fits."""

    def schedule(self, t: float, new: list[SimJob], active: list[SimJob], rnd: int) -> float:
        free = self.gpus
        for job in sorted(active + new, key=lambda j: (j.row.deadline, j.idx)):
            assert job.sc is not None
            want = min(job.sc.max_level, int(job.sc.down[free]))
            free -= want
            self._set(job, want)
            job.overhead = 0.0
        return math.inf


class FixedSize(Policy):
    """Jobs run at their trace GPU count for their trace duration (no elasticity)."""

    def rate(self, job: SimJob, alloc: int) -> float:
        return job.fixed_rate

    def _admit(self, job: SimJob, changed: bool, rnd: int) -> float:
        restart = rnd > 0 and rnd % RESTART_EVERY == 0
        if not (changed or restart):
            return 0.0
        cost = 7.0 if self.big else 2.0
        return cost + (math.log2(job.alloc) + 1) * 2 + ((47.0 if self.big else 27.0) if restart else 0.0)


class Tiresias(FixedSize):
    """dlas-gpu: discretised 2D-LAS. Queues by attained GPU-seconds; FIFO inside a queue with running
    jobs ahead of waiting ones; a job that does not fit is skipped (later ones may run)."""

    def __init__(self, gpus: int, data_root: Path, restart_cost_s: float) -> None:
        super().__init__(gpus, data_root, restart_cost_s)
        self.queues: list[list[SimJob]] = [[] for _ in range(len(TIRESIAS_LIMITS) + 1)]

    def schedule(self, t: float, new: list[SimJob], active: list[SimJob], rnd: int) -> float:
        self.queues[0].extend(new)
        for q, limit in enumerate(TIRESIAS_LIMITS):
            stay = []
            for job in self.queues[q]:
                if job.finish is not None:
                    continue
                (self.queues[q + 1] if job.attained >= limit else stay).append(job)
            self.queues[q] = stay
        self.queues[-1] = [j for j in self.queues[-1] if j.finish is None]
        free, wake = self.gpus, math.inf
        for q, queue in enumerate(self.queues):
            running, waiting = [], []
            for job in queue:
                want = job.row.num_gpu if job.row.num_gpu <= free else 0
                free -= want
                changed = self._set(job, want)
                job.overhead = self._admit(job, changed, rnd) if want else 0.0
                (running if want else waiting).append(job)
                if want and q < len(TIRESIAS_LIMITS):
                    wake = min(wake, t + job.overhead + (TIRESIAS_LIMITS[q] - job.attained) / want)
            self.queues[q] = running + waiting
        return wake


class FIFO(FixedSize):
    """First come first served at trace sizes, no backfilling (head-of-line blocking)."""

    def schedule(self, t: float, new: list[SimJob], active: list[SimJob], rnd: int) -> float:
        free = self.gpus
        blocked = False
        for job in active + new:
            want = job.row.num_gpu if not blocked and (job.alloc or job.row.num_gpu <= free) else 0
            blocked = blocked or want == 0
            free -= want
            changed = self._set(job, want)
            job.overhead = self._admit(job, changed, rnd) if want else 0.0
        return math.inf


POLICY_CLASSES: dict[str, type[Policy]] = {
    "elasticflow": ElasticFlow,
    "edf": EDF,
    "tiresias": Tiresias,
    "fifo": FIFO,
    "stalwart": Stalwart,
}

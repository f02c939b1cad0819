"""Event-driven cluster simulator over the ElasticFlow ITP traces (``stalwart sim``, Fig. 8b).

Time advances in scheduling rounds: a round happens at an arrival, a completion or a time a policy
asked to be woken at, but never sooner than ``SLOT`` seconds after the previous one (ElasticFlow's
simulator batches events the same way, scheduling_slot=60). Within a round every job's GPU count is
fixed; a job progresses at its profiled throughput after paying the round's overhead (restart cost).

Policies with ``event_ends`` (the ElasticFlow baseline) are accounted as ElasticFlow's own simulator
accounts them: a round's run time is capped at the job's planned end (``ceil(work left / rate)``)
*before* the overhead is taken off, and a job leaves only when its end event fires, at that planned
end rounded up to the slot plus the overhead, and only if no other event comes first; its recorded
finish (for the deadline) is the planned end of the round in which it left. So a job near its end
stalls while events keep arriving, holding its GPUs (and, if late, blocking admission). One departure:
a stalled job also leaves when the only earlier event was a policy wake-up (a planned rescaling),
which in ElasticFlow can postpone it indefinitely when the wake-up is itself waiting for its GPUs."""

from __future__ import annotations

import math
from pathlib import Path

from stalwart.sched.elasticflow_policies import POLICY_CLASSES, Policy, SimJob
from stalwart.sched.elasticflow_trace import DEFAULT_DATA_ROOT, cluster_gpus, load_trace, resolve_trace, trace_name
from stalwart.sched.sim_result import JobOutcome, Progress, SimResult

POLICIES: tuple[str, ...] = tuple(POLICY_CLASSES)
SLOT = 60.0
DEFAULT_RESTART_COST_S = 10.0


def simulate(
    trace_path_or_name: str | Path,
    policy: str,
    *,
    gpus: int | None = None,
    seed: int = 0,
    restart_cost_s: float = DEFAULT_RESTART_COST_S,
    progress: Progress | None = None,
    data_root: Path = DEFAULT_DATA_ROOT,
) -> SimResult:
    """Replay one trace under one policy. ``gpus`` defaults to the paper's cluster size for the trace.
    ``restart_cost_s`` is what the ``stalwart`` policy pays per reallocation; the ElasticFlow-like
    baselines model the overheads of ElasticFlow's own simulator instead. Every policy is
    deterministic; ``seed`` only orders exact ties and is kept for a uniform ``stalwart sim`` API."""
    if policy not in POLICY_CLASSES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    path = resolve_trace(trace_path_or_name, data_root)
    n_gpus = gpus if gpus is not None else cluster_gpus(path)
    if n_gpus <= 0:
        raise ValueError(f"gpus must be positive, got {n_gpus}")
    rows = load_trace(path, data_root)
    jobs = [SimJob(i, row) for i, row in enumerate(rows)]
    sched = POLICY_CLASSES[policy](n_gpus, data_root, restart_cost_s)
    for job in jobs:
        sched.prepare(job)
    _run(jobs, sched, n_gpus, progress)
    outcomes = [JobOutcome(j.row.name, j.row.submit, j.finish, j.row.deadline, gpu_seconds=j.gpu_seconds) for j in jobs]
    return SimResult(
        trace=trace_name(path),
        policy=policy,
        gpus=n_gpus,
        jobs=outcomes,
        reallocations=sum(j.reallocations for j in jobs),
        extra={
            "dropped": sum(j.dropped for j in jobs),
            "restart_cost_s": restart_cost_s if policy == "stalwart" else None,
            "job_reallocations": {j.row.name: j.reallocations for j in jobs if j.reallocations},
            "seed": seed,
        },
    )


def _run(jobs: list[SimJob], sched: Policy, gpus: int, progress: Progress | None) -> None:
    """The round loop shared by every policy (see the module docstring)."""
    nxt = 0
    active: list[SimJob] = []
    t = jobs[0].row.submit if jobs else 0.0
    rnd = 0
    done = 0
    while nxt < len(jobs) or active:
        new: list[SimJob] = []
        while nxt < len(jobs) and jobs[nxt].row.submit <= t:
            new.append(jobs[nxt])
            nxt += 1
        wake = sched.schedule(t, new, active, rnd)
        active = [j for j in active if not j.dropped] + [j for j in new if not j.dropped]
        used = sum(j.alloc for j in active)
        if used > gpus:
            raise AssertionError(f"policy {type(sched).__name__} allocated {used} > {gpus} GPUs at t={t}")
        horizon = jobs[nxt].row.submit if nxt < len(jobs) else math.inf
        for j in active:
            if j.alloc > 0:
                rate = sched.rate(j, j.alloc)
                if sched.event_ends:
                    j.real_end = t + max(0, math.ceil(j.left / rate - 1e-9))
                    j.eta = t + math.ceil((j.real_end - t) / SLOT) * SLOT + j.overhead
                else:
                    j.eta = j.real_end = t + j.overhead + j.left / rate
                horizon = min(horizon, j.eta)
        events = max(t + SLOT, horizon)  # the next arrival or end event
        horizon = min(horizon, wake)
        if math.isinf(horizon):
            if not active:
                break
            stuck = [j.row.name for j in active][:5]
            raise AssertionError(f"simulation stalled at t={t}: active jobs {stuck} get no GPUs and nothing is due")
        t_next = max(t + SLOT, horizon)
        still: list[SimJob] = []
        for j in active:
            if j.alloc > 0:
                run = min(t_next, j.real_end) - t - j.overhead if sched.event_ends else t_next - t - j.overhead
                j.gpu_seconds += j.alloc * min(t_next - t, j.eta - t)
                # a job that cannot progress any more (work left < overhead) still leaves if only a
                # policy wake-up came before its end event: else two plans can postpone each other forever
                stalled = sched.event_ends and j.real_end - t <= j.overhead and j.eta <= events
                if j.eta <= t_next or stalled:
                    j.finish, j.left = j.real_end, 0.0
                    done += 1
                    continue
                if run > 0:
                    j.left -= run * sched.rate(j, j.alloc)
                    j.attained += run * j.alloc
            still.append(j)
        active = still
        t = t_next
        rnd += 1
        if progress is not None and rnd % 200 == 0:
            progress(done, nxt)
    if progress is not None:
        progress(done, len(jobs))

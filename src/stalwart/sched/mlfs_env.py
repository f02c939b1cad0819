"""The environment the learned (``mlfs``) and the greedy (``hypersched``) policies are trained and judged
in: the Pollux simulator's jobs (``pollux_sim.SimJob``: measured step times, statistical-efficiency-
weighted progress, restart cost) driven by a policy that returns a GPU count per job, from a ladder of
powers of two. Episodes are windows of a Pollux workload (consecutive jobs by submit time, clock
rebased to the window's first submission) so that training sees many short episodes; evaluation runs
whole workloads.

What the policies see is a composable performance model: per job, the goodput at each ladder rung
(measured throughput × statistical efficiency at the job's batch and epoch, ``rung_goodput``) and its
remaining progress. Each interval's cost is the job-hours spent in the system, so an episode's total cost is its
total JCT."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

from stalwart.sched.pollux_goodput import gain as efficiency_gain
from stalwart.sched.pollux_policies import spread
from stalwart.sched.pollux_sim import NODES_GPUS, SimJob, fixed_batch_config, packed_placement
from stalwart.sched.pollux_workload import DEFAULT_ROOT, load_application, load_workload
from stalwart.sched.sim_result import JobOutcome, Progress

RUNGS: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64)  # the GPU counts a policy may give a job
N_FEATURES = 15


@dataclass(frozen=True)
class Window:
    """Jobs ``first .. first + count - 1`` (submit order) of Pollux workload ``workload``; ``count`` None:
    the whole workload."""

    workload: int
    first: int = 0
    count: int | None = None


@cache
def rung_goodput(root: Path, app_name: str, batch: int, epoch: int) -> np.ndarray:
    """Goodput (base-batch steps/s) of ``app_name`` at global ``batch`` in ``epoch`` at each rung, packed
    on as few nodes as possible: the measured step time (an oracle throughput model, as the Optimus+Oracle
    baseline's) × the statistical efficiency from the measured gradient noise; 0 at rung 0 and where the
    batch cannot be split that far. Cached: it depends on nothing else."""
    app = load_application(root, app_name)
    sqr, var = app.grad_stats(batch, epoch)
    gain = float(efficiency_gain(np.array(batch / app.init_batch_size), sqr, var))
    out = np.zeros(len(RUNGS))
    for k, gpus in enumerate(RUNGS):
        if gpus and gpus <= max(1, batch // app.min_local_bsz):
            atomic, accum = fixed_batch_config(app, batch, gpus)
            step, sync = app.step_time(packed_placement(gpus), atomic)
            out[k] = gain / (step + (step - sync) * accum)
    return out


def load_jobs(window: Window, root: Path = DEFAULT_ROOT) -> list[SimJob]:
    """The window's jobs as fresh ``SimJob``s at the workload's tuned batch (what Optimus and Tiresias run:
    these policies choose GPUs, not batch sizes), submit times rebased so the first job arrives at 0."""
    specs = load_workload(window.workload, root)
    end = None if window.count is None else window.first + window.count
    specs = specs[window.first : end]
    if not specs:
        raise ValueError(f"window {window} holds no jobs: workload {window.workload} has fewer")
    t0 = specs[0].submit
    out = []
    for s in specs:
        app = load_application(root, s.app)
        rebased = dataclasses.replace(s, submit=s.submit - t0)
        out.append(SimJob(rebased, app, root, s.batch_size))
    return out


def goodputs(job: SimJob) -> np.ndarray:
    return rung_goodput(job.root, job.app.name, job.spec.batch_size, min(job.epoch, job.app.max_epochs - 1))


def remaining(job: SimJob) -> float:
    """Progress left (base-batch steps)."""
    return max(job.app.target_progress - job.progress, 0.0)


def rung_of(gpus: int) -> int:
    """Index of the largest rung ≤ ``gpus``."""
    return max(i for i, r in enumerate(RUNGS) if r <= gpus)


def features(jobs: list[SimJob], now: float, gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """(features [jobs, N_FEATURES], valid-rung mask [jobs, len(RUNGS)]) of the active jobs. Features:
    current GPUs, running, restarting, progress done, age, remaining hours at 1 GPU, load, its rank by
    remaining time, and the believed speedup at each rung (the performance model)."""
    feats = np.zeros((len(jobs), N_FEATURES), dtype=np.float32)
    mask = np.zeros((len(jobs), len(RUNGS)), dtype=bool)
    rt1 = np.array([remaining(j) / max(goodputs(j)[1], 1e-9) for j in jobs])
    rank = np.argsort(np.argsort(rt1, kind="stable"), kind="stable") / max(len(jobs), 1)
    for i, job in enumerate(jobs):
        good = goodputs(job)
        speedup = np.where(good[2:] > 0, np.log2(np.maximum(good[2:], 1e-12) / max(good[1], 1e-12)), -1.0)
        feats[i, :9] = (
            math.log2(1 + len(job.alloc)) / 6,
            bool(job.alloc),
            job.restart_left > 0,
            job.progress / job.app.target_progress,
            math.log1p(max(now - job.spec.submit, 0.0) / 3600),
            math.log1p(rt1[i] / 3600),
            len(jobs) / gpus,
            rank[i],
            sum(len(j.alloc) for j in jobs) / gpus,
        )
        feats[i, 9:] = speedup[: N_FEATURES - 9] / 6
        mask[i] = [r == 0 or (r <= gpus and good[k] > 0) for k, r in enumerate(RUNGS)]
    return feats, mask


def grant(jobs: list[SimJob], wanted: list[int], gpus: int) -> list[int]:
    """Counts within capacity: shortest remaining time (at 1 GPU) first, each gets the largest rung ≤ its
    wish that still fits — so no policy output can over-allocate the cluster."""
    order = sorted(range(len(jobs)), key=lambda i: (remaining(jobs[i]) / max(goodputs(jobs[i])[1], 1e-9), i))
    out, free = [0] * len(jobs), gpus
    for i in order:
        out[i] = RUNGS[rung_of(min(wanted[i], free))]
        free -= out[i]
    return out


def place(jobs: list[SimJob], counts: list[int], gpus: int) -> list[tuple[int, ...]]:
    """Node ids per GPU: a job whose count is unchanged keeps its GPUs; the others are packed, largest
    first (whole free nodes, then the fullest node that fits), else spread over what is free."""
    nodes = gpus // NODES_GPUS
    out: list[tuple[int, ...]] = [()] * len(jobs)
    used = np.zeros(nodes, dtype=int)
    for i, job in enumerate(jobs):
        if counts[i] and len(job.alloc) == counts[i]:
            out[i] = job.alloc
            used += np.bincount(job.alloc, minlength=nodes)
    free = NODES_GPUS - used
    for i in sorted(range(len(jobs)), key=lambda i: (-counts[i], i)):
        want = counts[i]
        if not want or out[i]:
            continue
        whole = [n for n in range(nodes) if free[n] == NODES_GPUS][: want // NODES_GPUS]
        rest = want - len(whole) * NODES_GPUS
        fits = [n for n in range(nodes) if free[n] >= rest and n not in whole]
        if rest and fits:
            best = min(fits, key=lambda n: (free[n], n))
            alloc = [n for n in whole for _ in range(NODES_GPUS)] + [best] * rest
            free[whole], free[best] = 0, free[best] - rest
        elif not rest:
            alloc = [n for n in whole for _ in range(NODES_GPUS)]
            free[whole] = 0
        else:
            alloc = spread(free, want)
        out[i] = tuple(sorted(alloc))
    assert (free >= 0).all(), f"placement over-allocated a node: {free.tolist()}"
    return out


# A policy: (now, active jobs, cluster GPUs) -> wished GPU count per active job.
Chooser = Callable[[float, list[SimJob], int], list[int]]


@dataclass
class Episode:
    """One run: per-interval costs (job-hours in the system), GPU-hours, the outcome per job."""

    costs: list[float] = field(default_factory=list)
    outcomes: list[JobOutcome] = field(default_factory=list)
    gpu_hours: float = 0.0
    reallocations: int = 0

    @property
    def jct_hours(self) -> float:
        return sum(self.costs)


def run_episode(
    jobs: list[SimJob],
    chooser: Chooser,
    *,
    gpus: int = 64,
    interval_s: float = 60.0,
    restart_cost_s: float = 30.0,
    progress: Progress | None = None,
) -> Episode:
    """Advance ``jobs`` interval by interval under ``chooser`` until all finish (as ``pollux_sim`` does:
    the same job model, restart charge and interval); the cost of interval k is Σ over jobs of the time
    each spent in the system during it, so Σ costs = total JCT in hours."""
    if gpus < NODES_GPUS or gpus % NODES_GPUS:
        raise ValueError(f"gpus must be a positive multiple of {NODES_GPUS}, got {gpus}")
    ep, now = Episode(), 0.0
    horizon = max(j.spec.submit for j in jobs) + 10**7
    while any(j.finish is None for j in jobs):
        if now > horizon:
            raise RuntimeError("a policy left jobs unfinished for 10^7 s: it starves them")
        for job in jobs:
            job.advance(now, interval_s)
        end = now + interval_s
        cost = sum(max(min(j.finish or end, end) - max(j.spec.submit, now), 0.0) for j in jobs)
        ep.costs.append(cost / 3600)
        now = end
        if progress is not None:
            progress(sum(j.finish is not None for j in jobs), len(jobs))
        active = [j for j in jobs if j.spec.submit <= now and j.finish is None]
        if not active:
            continue
        counts = grant(active, chooser(now, active, gpus), gpus)
        for job, alloc in zip(active, place(active, counts, gpus), strict=True):
            job.reallocate(alloc, restart_cost_s)
    ep.outcomes = [JobOutcome(j.name, j.spec.submit, j.finish, gpu_seconds=j.gpu_seconds) for j in jobs]
    ep.gpu_hours = sum(j.gpu_seconds for j in jobs) / 3600
    ep.reallocations = sum(max(j.starts - 1, 0) for j in jobs)
    return ep

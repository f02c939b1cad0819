"""An event-driven cluster simulator over the Pollux (OSDI'21) artifact's workloads (Fig. 8a), with the
artifact simulator's semantics re-implemented here:

- 16 nodes × 4 GPUs; every ``interval_s`` the policy sees the unfinished submitted jobs and returns an
  allocation (one node id per GPU) for each; a job whose allocation changes restarts and makes no
  progress for ``restart_cost_s`` (the artifact charges 30 s, also on a job's first start).
- A job advances in statistical-efficiency-weighted progress: per second, gain / step_time, where the
  step time is the measured one for its placement and local batch and gain = (σ² + |g|²) / (σ²/s + |g|²)
  at batch scale s, from the gradient noise measured at that batch and epoch. It completes when its
  progress reaches ``Application.target_progress``; adaptive jobs re-pick their batch every epoch.
- Tuned-job baselines (``tiresias``, ``optimus``, ``fifo``) run each job at the workload file's batch
  size (and, for Tiresias/FIFO, its GPU count); ``pollux``/``stalwart`` choose both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalwart.sched.pollux_goodput import belief, optimize_batch
from stalwart.sched.pollux_workload import DEFAULT_ROOT, Application, WorkloadJob, load_application, load_workload
from stalwart.sched.sim_result import JobOutcome, Progress, SimResult

POLICIES: tuple[str, ...] = ("pollux", "optimus", "tiresias", "fifo", "stalwart")
NODES_GPUS = 4  # GPUs per node
NCF_BATCH = 32768  # the artifact runs NCF at a fixed batch under Pollux too (its batch range is tiny)


@dataclass
class SimJob:
    """A job's simulated state; ``alloc`` holds one node id per GPU (sorted)."""

    spec: WorkloadJob
    app: Application
    root: Path
    target_batch: int | None  # None: adaptive (the policy picks the batch by goodput)
    alloc: tuple[int, ...] = ()
    atomic_bsz: int = 0
    accum_steps: int = 0
    progress: float = 0.0
    epoch: int = 0
    restart_left: float = 0.0
    gpu_seconds: float = 0.0
    starts: int = 0  # allocations to a non-empty set (the first start counts too)
    max_seen_replicas: int = 0
    grad: tuple[float, float] | None = None  # last measured (|g|², σ²): what an adaptive job knows
    finish: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def placement(self) -> tuple[int, ...]:
        """Replicas per node, in node order."""
        return tuple(np.bincount(self.alloc).tolist()) if self.alloc else ()

    @property
    def batch(self) -> int:
        return len(self.alloc) * self.atomic_bsz * (self.accum_steps + 1)

    def reallocate(self, alloc: tuple[int, ...], restart_cost_s: float) -> None:
        """Move to ``alloc`` if it differs: reconfigure, and pay a (re)start unless it is no GPU at all."""
        if alloc == self.alloc:
            return
        self.alloc = alloc
        self.configure()
        if alloc:
            self.restart_left = restart_cost_s
            self.starts += 1

    def configure(self) -> None:
        """Pick (atomic batch, accumulation) for the current allocation."""
        if not self.alloc:
            self.atomic_bsz = self.accum_steps = 0
            return
        app, replicas = self.app, len(self.alloc)
        if self.target_batch is None and self.grad is not None:
            nodes = len(set(self.alloc))
            _, atomic, accum = optimize_batch(belief(self.root, app.name), app, nodes, replicas, self.grad)
            self.atomic_bsz, self.accum_steps = int(atomic[0]), int(accum[0])
            return
        batch = self.target_batch or max(app.init_batch_size, app.min_local_bsz * replicas)
        self.atomic_bsz, self.accum_steps = fixed_batch_config(app, batch, replicas)

    def advance(self, now: float, seconds: float) -> None:
        """Run ``seconds`` from ``now``: first any restart, then training, epoch by epoch."""
        if not self.alloc or self.finish is not None:
            return
        gpus = len(self.alloc)
        delay = min(self.restart_left, seconds)
        self.restart_left -= delay
        self.gpu_seconds += delay * gpus
        t, seconds = now + delay, seconds - delay
        while seconds > 1e-9 and self.finish is None:
            batch = self.batch
            step, sync = self.app.step_time(self.placement, self.atomic_bsz)
            sqr, var = self.app.grad_stats(batch, self.epoch)
            self.grad = (sqr, var)
            self.max_seen_replicas = max(self.max_seen_replicas, gpus)
            scale = batch / self.app.init_batch_size
            gain = (var + sqr) / (var / scale + sqr) if var / scale + sqr > 0 else 1.0
            rate = gain / (step + (step - sync) * self.accum_steps)  # progress per second
            target = self.app.progress_at(self.epoch + 1)
            needed = (target - self.progress) / rate
            if needed > seconds:
                self.progress += rate * seconds
                self.gpu_seconds += seconds * gpus
                return
            self.progress, self.epoch = target, self.epoch + 1
            t, seconds = t + needed, seconds - needed
            self.gpu_seconds += needed * gpus
            if self.epoch >= self.app.max_epochs:
                self.finish = t
                return
            self.configure()  # adaptive jobs re-pick the batch between epochs


def fixed_batch_config(app: Application, batch: int, replicas: int, *, single_accum: bool = False) -> tuple[int, int]:
    """(atomic batch, accumulation) that realise ``batch`` over ``replicas`` within the local-batch
    cap; one replica above the base batch (or always, with ``single_accum``: Optimus's estimate)
    accumulates at least once, as the artifact does."""
    local = math.ceil(batch / replicas - 1e-8)
    accum = math.ceil(local / app.max_local_bsz - 1e-8) - 1
    if replicas == 1 and (single_accum or batch > app.init_batch_size):
        accum = max(1, accum)
    atomic = math.ceil(local / (accum + 1) - 1e-8)
    atomic = min(atomic, app.max_batch_size // (replicas * (accum + 1)))
    return max(atomic, 1), accum


def packed_placement(gpus: int) -> tuple[int, ...]:
    """``gpus`` replicas on as few nodes as possible (full nodes first)."""
    return tuple(min(NODES_GPUS, gpus - i) for i in range(0, gpus, NODES_GPUS))


def simulate(
    workload: str | int | Path,
    policy: str,
    *,
    gpus: int = 64,
    seed: int = 0,
    restart_cost_s: float = 30.0,
    interval_s: float = 60.0,
    progress: Progress | None = None,
    data_root: Path = DEFAULT_ROOT,
) -> SimResult:
    """Run ``policy`` over a workload (1..8 or a CSV path) until every job finishes. Every policy is
    deterministic (ties break by job and node order), so ``seed`` is only recorded; ``restart_cost_s``
    is what each (re)start costs in the simulation (the artifact's 30 s), and what ``stalwart`` charges.
    ``reallocations`` counts restarts after a job's first start (resizes, moves, resumptions)."""
    from stalwart.sched.pollux_policies import make_policy

    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if gpus < NODES_GPUS or gpus % NODES_GPUS:
        raise ValueError(f"gpus must be a positive multiple of {NODES_GPUS}, got {gpus}")
    if interval_s <= 0 or restart_cost_s < 0:
        raise ValueError(f"need interval_s > 0 and restart_cost_s ≥ 0, got {interval_s} and {restart_cost_s}")
    root = Path(data_root)
    specs = load_workload(workload, root)
    adaptive = policy in ("pollux", "stalwart")
    jobs = []
    for s in specs:
        app = load_application(root, s.app)
        target = (NCF_BATCH if s.app == "ncf" else None) if adaptive else s.batch_size
        jobs.append(SimJob(s, app, root, target))
    nodes = gpus // NODES_GPUS
    chooser = make_policy(policy, nodes=nodes, restart_cost_s=restart_cost_s, interval_s=interval_s, seed=seed)
    now = 0.0
    horizon = max(s.submit for s in specs) + 10**7  # a guard against a policy that never finishes jobs
    while any(j.finish is None for j in jobs):
        if now > horizon:
            raise RuntimeError(f"{policy} left jobs unfinished for 10^7 s; the policy starves them")
        for job in jobs:
            job.advance(now, interval_s)
        now += interval_s
        if progress is not None:
            progress(sum(j.finish is not None for j in jobs), len(jobs))
        active = [j for j in jobs if j.spec.submit <= now and j.finish is None]
        if not active:
            continue
        allocs = chooser.schedule(now, active)
        _check(allocs, nodes, policy)
        for job in active:
            job.reallocate(tuple(sorted(allocs.get(job.name, ()))), restart_cost_s)
    reallocations = sum(max(j.starts - 1, 0) for j in jobs)  # restarts after the first start
    outcomes = [JobOutcome(j.name, j.spec.submit, j.finish, gpu_seconds=j.gpu_seconds) for j in jobs]
    name = Path(workload_label(workload)).stem
    extra = {"restart_cost_s": restart_cost_s, "interval_s": interval_s, "seed": seed}
    return SimResult(name, policy, gpus, outcomes, reallocations=reallocations, extra=extra)


def workload_label(workload: str | int | Path) -> str:
    return f"workload-{int(workload)}" if str(workload).isdigit() else str(workload)


def _check(allocs: dict[str, tuple[int, ...]], nodes: int, policy: str) -> None:
    used = np.bincount([n for a in allocs.values() for n in a], minlength=nodes)
    if len(used) > nodes or used.max(initial=0) > NODES_GPUS:
        raise RuntimeError(f"policy {policy} over-allocated nodes: GPUs per node {used.tolist()}")

"""Scheduling policies for the Pollux simulator (``pollux_sim``). Each is an object with
``schedule(now, jobs) -> {job name: node ids, one per GPU}`` called every scheduling interval with the
unfinished submitted jobs; a job left out gets nothing.

The tuned-job baselines follow the Pollux artifact's: Tiresias (two-queue discretised least-attained
service, 16 GPU-hour threshold, each job at its workload GPU count), Optimus+Oracle (greedy marginal
step-time gain × remaining iterations with the true step times), plus plain FIFO. The goodput
policies (``pollux``, ``stalwart``) live in ``pollux_alloc``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from stalwart.sched.pollux_sim import NODES_GPUS, SimJob, fixed_batch_config, packed_placement


class Policy(Protocol):
    def schedule(self, now: float, jobs: list[SimJob]) -> dict[str, tuple[int, ...]]: ...


def make_policy(name: str, *, nodes: int, restart_cost_s: float, interval_s: float, seed: int) -> Policy:
    from stalwart.sched.pollux_alloc import GoodputPolicy

    if name == "tiresias":
        return TiresiasPolicy(nodes)
    if name == "optimus":
        return OptimusPolicy(nodes)
    if name == "fifo":
        return FifoPolicy(nodes)
    if name in ("pollux", "stalwart"):
        return GoodputPolicy(nodes, objective=name, restart_cost_s=restart_cost_s, interval_s=interval_s)
    raise ValueError(f"unknown policy {name!r}")


def spread(free: np.ndarray, gpus: int) -> list[int]:
    """Take ``gpus`` GPUs, each time from the node with the most free (lowest id on ties), as the
    artifact's baselines do; ``free`` is updated in place."""
    out: list[int] = []
    while len(out) < gpus:
        node = int(np.argmax(free))
        take = min(int(free[node]), gpus - len(out))
        if take <= 0:
            raise RuntimeError(f"no free GPU left for {gpus - len(out)} more replicas")
        out += [node] * take
        free[node] -= take
    return out


def _free(nodes: int, kept: dict[str, tuple[int, ...]]) -> np.ndarray:
    used = np.bincount([n for a in kept.values() for n in a], minlength=nodes)
    return NODES_GPUS - used


class FifoPolicy:
    """Arrival order, each job at its workload GPU count, no preemption and no backfilling: a job that
    does not fit blocks the ones behind it."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    def schedule(self, now: float, jobs: list[SimJob]) -> dict[str, tuple[int, ...]]:
        kept = {j.name: j.alloc for j in jobs if j.alloc}
        free = _free(self.nodes, kept)
        for job in sorted(jobs, key=lambda j: j.spec.submit):
            if job.alloc:
                continue
            want = job.spec.num_replicas
            if want > free.sum():
                break
            kept[job.name] = tuple(spread(free, want))
        return kept


class TiresiasPolicy:
    """Two-queue discretised LAS: jobs start in queue 0 and drop to queue 1 after 16 GPU-hours of
    service; queue 0 before queue 1, FIFO within a queue; a job that does not fit is skipped (others
    behind it may still run) and preempted if it was running."""

    THRESHOLD_GPU_S = 16 * 3600.0

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.queues: tuple[list[str], list[str]] = ([], [])
        self.running: set[str] = set()
        self.executed: dict[str, float] = {}
        self.last_check: dict[str, float] = {}

    def schedule(self, now: float, jobs: list[SimJob]) -> dict[str, tuple[int, ...]]:
        by_name = {j.name: j for j in jobs}
        for q in self.queues:
            q[:] = [k for k in q if k in by_name]
        for job in jobs:
            if job.name not in self.executed:
                self.executed[job.name], self.last_check[job.name] = 0.0, now
                self.queues[0].append(job.name)
        for name, job in by_name.items():
            if name in self.running:
                self.executed[name] += now - self.last_check[name]
                if name in self.queues[0] and self.executed[name] * job.spec.num_replicas >= self.THRESHOLD_GPU_S:
                    self.queues[0].remove(name)
                    self.queues[1].append(name)
            self.last_check[name] = now
        left = self.nodes * NODES_GPUS
        self.running = set()
        for name in self.queues[0] + self.queues[1]:
            if by_name[name].spec.num_replicas <= left:
                self.running.add(name)
                left -= by_name[name].spec.num_replicas
        kept = {k: by_name[k].alloc for k in self.running if by_name[k].alloc}
        free = _free(self.nodes, kept)
        for name in self.queues[0] + self.queues[1]:
            if name in self.running and name not in kept:
                kept[name] = tuple(spread(free, by_name[name].spec.num_replicas))
        return kept


class OptimusPolicy:
    """Optimus with an oracle: one GPU per job in arrival order, then GPUs one at a time to the job
    whose remaining time (remaining iterations × true step time at its tuned batch) drops most."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    def schedule(self, now: float, jobs: list[SimJob]) -> dict[str, tuple[int, ...]]:
        left = self.nodes * NODES_GPUS
        count: dict[str, int] = {}
        gain: dict[str, float] = {}
        for job in jobs:  # arrival order
            count[job.name] = 1 if left >= 1 else 0
            left -= count[job.name]
            gain[job.name] = self._gain(job, count[job.name]) if count[job.name] and left else 0.0
        by_name = {j.name: j for j in jobs}
        while left > 0 and gain and max(gain.values()) > 0:
            name = max(gain, key=gain.__getitem__)
            count[name] += 1
            left -= 1
            gain[name] = self._gain(by_name[name], count[name]) if left else 0.0
        kept = {j.name: j.alloc for j in jobs if j.alloc and len(j.alloc) == count[j.name]}
        free = _free(self.nodes, kept)
        for job in sorted(jobs, key=lambda j: count[j.name]):
            if count[job.name] and job.name not in kept:
                kept[job.name] = tuple(spread(free, count[job.name]))
        return kept

    def _gain(self, job: SimJob, replicas: int) -> float:
        """Step time saved by one more GPU × iterations left (0 past the job's useful maximum)."""
        app, batch = job.app, job.spec.batch_size
        if app.name == "ncf" or replicas + 1 > batch // app.min_local_bsz:
            return 0.0
        last = app.max_epochs - 1
        remaining = app.iterations(batch, last) - app.iterations(batch, job.epoch) if job.epoch < last else 1.0
        return (self._step(job, replicas) - self._step(job, replicas + 1)) * remaining

    @staticmethod
    def _step(job: SimJob, replicas: int) -> float:
        atomic, accum = fixed_batch_config(job.app, job.spec.batch_size, replicas, single_accum=True)
        step, sync = job.app.step_time(packed_placement(replicas), atomic)
        return step + (step - sync) * accum

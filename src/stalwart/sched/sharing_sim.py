"""GPU-sharing cluster simulator (``stalwart sim sharing``, issue 29): production jobs, opportunistic jobs,
and policies that let two jobs share GPUs (``sharing_policies``), over the ElasticFlow traces and the
Pollux workloads (``sharing_trace``), with pair throughputs from the interference model.

Model of a cluster: ``gpus`` interchangeable GPUs. A job runs exclusively on its GPU count, or as the
*guest* of a running *host* job with at least as many GPUs (on a subset of them: it holds none of its
own). Between events every job's normalised throughput is fixed (1 alone; a pair's from the policy);
a (re)start costs ``restart_cost_s`` of no progress. When a host ends, its guest keeps running on its
GPUs as an exclusive job (nothing moves); a preempted job keeps its progress (checkpointed).

"Truth" is the interference model's prediction perturbed per pair by a deterministic draw of its
held-out RMSE, so a policy that plans with the model (``muxflow``, ``stalwart``) plans with an error of
the size measured on held-back pairs; the runtime guard that holds production jobs within the bound
(AntMan's yielding, MuxFlow's SM limit) sees the truth, as a live system measures it.

Outputs, besides each job's JCT, over the arrival window (first to last submission: the drain after
the last arrival would dilute every policy alike): GPU utilisation (time-average of the fraction of GPU time a kernel
runs: a job keeps its GPUs busy ``busy × throughput`` of the time, two jobs on a GPU add up to 1 at
most), work per GPU (normalised throughput summed over jobs per GPU), production slowdown (running
time / solo time, mean and worst, and the lowest throughput a production job had while running) and
opportunistic JCT.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalwart.sched.interference import InterferenceModel, JobFeatures, default_model
from stalwart.sched.sharing_trace import ShareSpec, load_jobs
from stalwart.sched.sim_result import JobOutcome, Progress, SimResult

SLOT = 60.0  # a policy acts at most once a minute (as the other simulators)
DEFAULT_BOUND = 0.1  # a production job keeps ≥ 90 % of its solo throughput under antman/muxflow/stalwart
DEFAULT_RESTART_COST_S = 30.0


@dataclass(eq=False)
class Job:
    spec: ShareSpec
    left: float  # solo seconds of work still to do
    mode: str = "wait"  # wait | excl | guest | done
    host: Job | None = None  # for a guest
    guest: Job | None = None  # for a job that hosts one
    tp: float = 0.0
    restart_left: float = 0.0
    started_at: float = -1.0
    finish: float | None = None
    gpu_seconds: float = 0.0
    run_seconds: float = 0.0  # running time, restarts excluded
    min_tp: float = 1.0
    preemptions: int = 0

    @property
    def features(self) -> JobFeatures:
        return self.spec.features


class Truth:
    """Pair throughputs as they really are in the simulation (see the module docstring)."""

    def __init__(self, model: InterferenceModel, seed: int) -> None:
        self.model, self.seed = model, seed
        self.sigma = float(model.report.get("heldout_rmse_gpu", model.report.get("heldout_rmse", 0.0)))
        self._memo: dict[tuple[JobFeatures, JobFeatures], tuple[float, float]] = {}

    def pair(self, a: JobFeatures, b: JobFeatures) -> tuple[float, float]:
        if (a, b) not in self._memo:
            pa, pb = self.model.pair(a, b)
            rng = np.random.default_rng(zlib.crc32(repr((a, b)).encode()) ^ self.seed)
            za, zb = rng.standard_normal(2) * self.sigma
            self._memo[a, b] = (float(np.clip(pa + za, 0.02, 1.0)), float(np.clip(pb + zb, 0.02, 1.0)))
        return self._memo[a, b]


class Cluster:
    """The state a policy reads and changes: waiting and running jobs, free GPUs."""

    def __init__(self, gpus: int, restart_cost_s: float) -> None:
        self.gpus, self.free, self.restart_cost_s = gpus, gpus, restart_cost_s
        self.waiting: list[Job] = []  # by submission
        self.running: list[Job] = []  # exclusive jobs (hosts included) and guests
        self.now = 0.0

    def _start(self, job: Job, mode: str) -> None:
        job.mode, job.restart_left, job.started_at = mode, self.restart_cost_s, self.now
        self.waiting.remove(job)
        self.running.append(job)

    def run_exclusive(self, job: Job) -> None:
        assert job.mode == "wait" and job.spec.gpus <= self.free, (job.mode, job.spec.gpus, self.free)
        self.free -= job.spec.gpus
        self._start(job, "excl")

    def attach(self, host: Job, guest: Job) -> None:
        assert host.mode == "excl" and host.guest is None and guest.spec.gpus <= host.spec.gpus
        host.guest, guest.host = guest, host
        self._start(guest, "guest")

    def stop(self, job: Job) -> None:
        """Back to waiting (progress kept); a host's guest goes back too."""
        if job.guest is not None:
            self.stop(job.guest)
        if job.mode == "guest":
            assert job.host is not None
            job.host.guest, job.host = None, None
        else:
            self.free += job.spec.gpus
        job.mode, job.tp = "wait", 0.0
        job.preemptions += 1
        self.running.remove(job)
        self.waiting.append(job)
        self.waiting.sort(key=lambda j: j.spec.submit)

    def promote(self, guest: Job) -> None:
        """A guest moves to GPUs of its own (a restart)."""
        self.stop(guest)
        guest.preemptions -= 1
        self.run_exclusive(guest)

    def hosts(self) -> list[Job]:
        """Running production jobs without a guest: where an opportunistic job may share."""
        return [j for j in self.running if j.mode == "excl" and j.spec.production and j.guest is None]

    def make_room(self, job: Job) -> bool:
        """Preempt opportunistic exclusive jobs (latest started first) until ``job`` fits; False if it cannot."""
        victims = sorted(
            (j for j in self.running if j.mode == "excl" and not j.spec.production), key=lambda j: -j.started_at
        )
        if self.free + sum(v.spec.gpus for v in victims) < job.spec.gpus:
            return False
        for v in victims:
            if self.free >= job.spec.gpus:
                break
            self.stop(v)
        return True

    def _end(self, job: Job, at: float) -> None:
        job.finish, job.mode, job.left = at, "done", 0.0
        self.running.remove(job)
        if job.host is not None:  # a guest ends: the host runs alone
            job.host.guest, job.host = None, None
            return
        self.free += job.spec.gpus
        if job.guest is not None:  # the host ends: its guest keeps its GPUs, now its own
            guest, job.guest = job.guest, None
            guest.host, guest.mode = None, "excl"
            self.free -= guest.spec.gpus


def simulate(
    trace: str,
    policy: str,
    *,
    seed: int = 0,
    production_share: float = 0.5,
    bound: float = DEFAULT_BOUND,
    restart_cost_s: float = DEFAULT_RESTART_COST_S,
    max_jobs: int | None = None,
    model: InterferenceModel | None = None,
    progress: Progress | None = None,
    data_root: Path | None = None,
) -> SimResult:
    """Replay ``trace`` (cluster01..10, workload1..8) under a sharing policy; deterministic under ``seed``
    (it picks the production jobs, the model's held-out split and the truth's perturbation)."""
    from stalwart.sched.sharing_policies import make_policy

    if not 0.0 < bound < 1.0 or restart_cost_s < 0:
        raise ValueError(f"need 0 < bound < 1 and restart_cost_s ≥ 0, got {bound} and {restart_cost_s}")
    model = model or default_model(seed)
    specs, gpus = load_jobs(trace, seed=seed, production_share=production_share, max_jobs=max_jobs, data_root=data_root)
    jobs = [Job(s, s.work) for s in specs]
    truth = Truth(model, seed)
    sched = make_policy(policy, model=model, truth=truth, bound=bound, restart_cost_s=restart_cost_s)
    cluster = Cluster(gpus, restart_cost_s)
    busy_gpu_s = work_gpu_s = shared_s = 0.0
    nxt, t, done = 0, (jobs[0].spec.submit if jobs else 0.0), 0
    while nxt < len(jobs) or cluster.running or cluster.waiting:
        cluster.now = t
        while nxt < len(jobs) and jobs[nxt].spec.submit <= t:
            cluster.waiting.append(jobs[nxt])
            nxt += 1
        sched.schedule(cluster)
        assert 0 <= cluster.free <= gpus, cluster.free
        for j in cluster.running:
            if j.mode == "excl":
                j.tp = 1.0 if j.guest is None else sched.rates(j, j.guest)[0]
                if j.guest is not None:
                    j.guest.tp = sched.rates(j, j.guest)[1]
        ends = [t + j.restart_left + j.left / j.tp for j in cluster.running if j.tp > 0]
        arrival = jobs[nxt].spec.submit if nxt < len(jobs) else math.inf
        t_next = max(t + SLOT, min([arrival, *ends]))
        if math.isinf(t_next):
            stuck = [j.spec.name for j in cluster.waiting][:5]
            raise AssertionError(f"{policy}: jobs {stuck} can never run (more GPUs than the cluster has?)")
        finished = []
        last = jobs[-1].spec.submit if jobs else t  # utilisation counts the arrival window, not the drain
        window = max(0.0, min(t_next, last) - t) / (t_next - t)
        for j in list(cluster.running):
            dt = t_next - t
            pause = min(j.restart_left, dt)
            j.restart_left -= pause
            active = dt - pause
            if j.tp > 0 and j.left <= active * j.tp + 1e-9:
                active = j.left / j.tp
                finished.append((j, t + pause + active))
            j.left = max(0.0, j.left - active * j.tp)
            j.run_seconds += active
            if j.spec.production and active > 0:
                j.min_tp = min(j.min_tp, j.tp)
            j.gpu_seconds += (pause + active) * (j.spec.gpus if j.mode == "excl" else 0)
            counted = active * window
            work_gpu_s += counted * j.tp * j.spec.gpus
            if j.mode == "guest":
                assert j.host is not None
                room = max(0.0, 1.0 - j.host.spec.busy * j.host.tp)
                busy_gpu_s += counted * min(j.spec.busy * j.tp, room) * j.spec.gpus
                shared_s += counted * j.spec.gpus
            else:
                busy_gpu_s += counted * j.spec.busy * j.tp * j.spec.gpus
        for j, at in sorted(finished, key=lambda x: x[1]):
            cluster._end(j, at)
            done += 1
        t = t_next
        if progress is not None:
            progress(done, len(jobs))
    return _result(trace, policy, gpus, jobs, busy_gpu_s, work_gpu_s, shared_s, model, bound, seed, production_share)


def _result(trace, policy, gpus, jobs, busy_gpu_s, work_gpu_s, shared_s, model, bound, seed, share) -> SimResult:
    span = max(1.0, jobs[-1].spec.submit - jobs[0].spec.submit)  # the arrival window
    prod = [j for j in jobs if j.spec.production]
    opp = [j for j in jobs if not j.spec.production]

    def avg(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    extra = {
        "gpu_util": busy_gpu_s / (gpus * span),
        "work_per_gpu": work_gpu_s / (gpus * span),
        "shared_gpu_frac": shared_s / (gpus * span),
        "prod_jobs": len(prod),
        "prod_slowdown_mean": avg([j.run_seconds / j.spec.work for j in prod]),
        "prod_slowdown_max": max((j.run_seconds / j.spec.work for j in prod), default=None),
        "prod_min_tput": min((j.min_tp for j in prod), default=None),
        "prod_bound_ok": all(j.min_tp >= 1 - bound - 1e-9 for j in prod),
        "prod_avg_jct_s": avg([j.finish - j.spec.submit for j in prod]),
        "opp_avg_jct_s": avg([j.finish - j.spec.submit for j in opp]),
        "preemptions": sum(j.preemptions for j in jobs),
        "bound": bound,
        "production_share": share,
        "model_heldout_mae": model.report.get("heldout_mae"),
        "seed": seed,
    }
    outcomes = [JobOutcome(j.spec.name, j.spec.submit, j.finish, gpu_seconds=j.gpu_seconds) for j in jobs]
    return SimResult(trace, policy, gpus, outcomes, reallocations=extra["preemptions"], extra=extra)

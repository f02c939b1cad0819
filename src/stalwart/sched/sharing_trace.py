"""Jobs for the GPU-sharing simulator (``sharing_sim``), from the ElasticFlow traces and the Pollux
workloads that ``stalwart sim`` already ships, each marked production or opportunistic.

A job needs what sharing decisions read: GPU count, solo run time, and the interference model's features.
- ElasticFlow (``cluster01``..``cluster10``): the trace's GPU count and duration; per-GPU batch = global
  batch / GPUs; idle fraction = 1 - scaling efficiency at that GPU count (throughput at g GPUs over g
  times the 1-GPU throughput, from the A100 tables): the time a GPU waits on communication. At the
  paper's cluster sizes these traces offer 2-48 % of the cluster's GPU time (ElasticFlow's contention
  comes from deadlines, not volume), which leaves nothing to share; so arrivals are compressed in time
  (submission offsets scaled by one factor) until the offered load, sum(GPUs x solo time) / (cluster
  GPUs x trace span), is ``load`` (default 1.5: an overloaded cluster, where sharing matters; None keeps
  the recorded times).
- Pollux (``workload1``..``workload8``): the workload file's GPUs and batch; solo run time = the Pollux
  simulator's own run of the job alone at that allocation; idle fraction = sync time / step time of the
  measured placement.
Marking: job i is production when ``rng.random() < production_share`` for ``rng =
numpy.random.default_rng(seed)`` drawn in submission order, so a seed fixes the marking.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stalwart.sched.interference import JobFeatures

FAMILY = {
    "resnet50": "conv", "resnet50_cifar10": "conv", "inception3": "conv", "vgg16": "conv", "cifar10": "conv",
    "imagenet": "conv", "yolov3": "conv", "bert": "transformer", "gpt2": "transformer", "deepspeech2": "rnn",
    "ncf": "embedding",
}  # fmt: skip
TRACE_NAMES = [f"cluster{i:02d}" for i in range(1, 11)] + [f"workload{i}" for i in range(1, 9)]


@dataclass(frozen=True)
class ShareSpec:
    """One job as the sharing simulator sees it."""

    name: str
    submit: float
    gpus: int
    work: float  # solo run time (s) on ``gpus`` dedicated GPUs
    production: bool
    features: JobFeatures

    @property
    def busy(self) -> float:
        """Fraction of time the job's kernels occupy its GPUs when it runs alone."""
        return 1.0 - self.features.idle


def load_jobs(
    trace: str,
    *,
    seed: int = 0,
    production_share: float = 0.5,
    max_jobs: int | None = None,
    load: float | None = 1.5,
    data_root: Path | None = None,
) -> tuple[list[ShareSpec], int]:
    """(jobs by submission, cluster GPUs) of a named trace; ``max_jobs`` keeps the first ones."""
    if not 0.0 <= production_share <= 1.0:
        raise ValueError(f"production_share must be in [0, 1], got {production_share}")
    if m := re.fullmatch(r"cluster(\d\d)", trace):
        jobs, gpus = _elasticflow(trace, max_jobs, data_root)
        jobs = _compress(jobs, gpus, load)
    elif m := re.fullmatch(r"workload(\d)", trace):
        jobs, gpus = _pollux(int(m[1]), max_jobs, data_root)
    else:
        raise ValueError(f"unknown trace {trace!r}; choose from {', '.join(TRACE_NAMES)}")
    marks = np.random.default_rng(seed).random(len(jobs)) < production_share
    out = [ShareSpec(n, s, g, w, bool(p), f) for (n, s, g, w, f), p in zip(jobs, marks)]
    return out, gpus


def _compress(jobs: list, gpus: int, load: float | None) -> list:
    """Scale submission offsets so the offered load is ``load`` (only ever compress)."""
    if load is None or len(jobs) < 2:
        return jobs
    if load <= 0:
        raise ValueError(f"load must be positive, got {load}")
    start = jobs[0][1]
    span = max(j[1] for j in jobs) - start
    offered = sum(j[2] * j[3] for j in jobs) / (gpus * span) if span > 0 else math.inf
    factor = min(1.0, offered / load)
    return [(n, start + (s - start) * factor, g, w, f) for n, s, g, w, f in jobs]


def _elasticflow(trace: str, max_jobs: int | None, root: Path | None) -> tuple[list, int]:
    from stalwart.sched import elasticflow_trace as ef

    root = root or ef.DEFAULT_DATA_ROOT
    rows = ef.load_trace(trace, root)[:max_jobs]
    gpus = ef.cluster_gpus(trace)
    jobs = []
    for r in rows:
        table = ef.load_throughputs(root, r.model).get(r.batch_size, {})
        one, at = table.get(1), table.get(r.num_gpu)
        efficiency = at / (r.num_gpu * one) if one and at else 1.0
        duration = r.duration if math.isfinite(r.duration) and r.duration > 0 else r.iterations / at if at else 3600.0
        feats = JobFeatures(FAMILY[r.model], r.batch_size / r.num_gpu, float(np.clip(1.0 - efficiency, 0.0, 0.9)))
        jobs.append((r.name, r.submit, min(r.num_gpu, gpus), float(duration), feats))
    return jobs, gpus


def _pollux(workload: int, max_jobs: int | None, root: Path | None) -> tuple[list, int]:
    from stalwart.sched import pollux_sim as ps
    from stalwart.sched.pollux_workload import DEFAULT_ROOT, load_application, load_workload

    root = root or DEFAULT_ROOT
    jobs = []
    for spec in load_workload(workload, root)[:max_jobs]:
        app = load_application(root, spec.app)
        placement = ps.packed_placement(spec.num_replicas)
        alone = ps.SimJob(spec, app, root, spec.batch_size)
        alone.alloc = tuple(sorted(n for n, count in enumerate(placement) for _ in range(count)))
        alone.configure()
        alone.advance(0.0, 1e9)
        step, sync = app.step_time(placement, alone.atomic_bsz)
        idle = float(np.clip(sync / step if step > 0 else 0.0, 0.0, 0.9))
        feats = JobFeatures(FAMILY[spec.app], spec.batch_size / spec.num_replicas, idle)
        jobs.append((spec.name, spec.submit, spec.num_replicas, float(alone.finish or 3600.0), feats))
    return jobs, 64

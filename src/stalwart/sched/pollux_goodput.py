"""What an adaptive scheduler believes about a job's goodput in the Pollux simulator: the Pollux
step-time model (``throughput.fit``) fitted once per application on its measured traces, times the
statistical efficiency (``goodput.efficiency``) from the job's last measured gradient noise. The
simulated truth stays the measured step times (``Application.step_time``); only decisions use this.

The artifact fits each job's model online from the configurations that job has run; fitting on the
whole trace once is ~100× cheaper and only more optimistic for configurations a job has not tried —
which Pollux's exploration cap (≤ 2× the replicas a job has run on) still guards.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np

from stalwart.sched.pollux_workload import Application
from stalwart.sched.throughput import ThroughputModel, fit
from stalwart.sched.traces import load_app

_BATCH_GRID = 32  # geometric grid of global batch sizes searched per configuration
_EPS = 1e-8


@cache
def belief(root: Path, app: str) -> ThroughputModel:
    """The step-time model fitted to every measurement of ``app`` (cached per data root)."""
    return fit(load_app(Path(root) / "traces", app))


def optimize_batch(
    model: ThroughputModel,
    app: Application,
    nodes: np.ndarray | int,
    replicas: np.ndarray | int,
    grad: tuple[float, float],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best believed (goodput, atomic batch, accumulation steps) per (nodes, replicas) pair, over global
    batches from max(base batch, min local batch × replicas) to the largest measured one. Goodput is in
    base-batch steps per second (the simulator's progress unit); 0 where no batch fits."""
    n = np.atleast_1d(np.asarray(nodes, dtype=float))
    r = np.atleast_1d(np.asarray(replicas, dtype=float))
    init, top = float(app.init_batch_size), float(app.max_batch_size)
    low = np.maximum(init, app.min_local_bsz * r)
    frac = np.linspace(0.0, 1.0, _BATCH_GRID)[:, None]
    batch = low * (np.maximum(top, low) / low) ** frac  # (grid, configs)
    local = batch / r
    accum = np.ceil(local / app.max_local_bsz - _EPS) - 1
    accum = np.where((r == 1) & (local > init + _EPS), np.maximum(accum, 1), accum)
    atomic = np.minimum(np.ceil(local / (accum + 1) - _EPS), np.floor(top / (r * (accum + 1))))  # ≤ max batch
    real = r * atomic * (accum + 1)
    grad_t, sync = model.terms(np.broadcast_to(n, atomic.shape), np.broadcast_to(r, atomic.shape), atomic)
    step = (grad_t**model.gamma + sync**model.gamma) ** (1.0 / model.gamma) + accum * grad_t
    goodput = gain(real / init, *grad) / step
    ok = (atomic >= app.min_local_bsz) & (atomic <= app.max_local_bsz) & (low <= top)
    goodput = np.where(ok, goodput, 0.0)
    best = np.argmax(goodput, axis=0)
    cols = np.arange(goodput.shape[1])
    return goodput[best, cols], atomic[best, cols].astype(int), accum[best, cols].astype(int)


def gain(scale: np.ndarray, grad_sqr: float, grad_var: float) -> np.ndarray:
    """Progress per step at ``scale`` × the base batch: scale × ``goodput.efficiency`` (vectorised)."""
    if grad_sqr <= 0:
        return np.ones_like(scale)
    return (grad_var + grad_sqr) / (grad_var / scale + grad_sqr)

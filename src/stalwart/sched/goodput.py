"""Goodput = throughput × statistical efficiency (Pollux, OSDI'21 §3), and the configuration that
maximises it.

Statistical efficiency of a global batch M relative to the batch M0 the job's hyper-parameters were
tuned for, from the gradient noise the job measures (``grad_sqr`` = |E g|², ``grad_var`` = tr Σ per
sample-batch of M0; Pollux's estimator): with s = M / M0,

    efficiency(M) = ((grad_var + grad_sqr) / (grad_var / s + grad_sqr)) / s   ∈ (0, 1] for s ≥ 1

— one sample of a larger batch is worth less progress once the gradient noise no longer dominates.
With the global batch fixed (stalwart's default: the sample order and the loss curve stay exact),
efficiency is a constant and the best configuration is the one with the highest throughput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stalwart.sched.throughput import ThroughputModel


def efficiency(batch: float, base_batch: float, grad_sqr: float | None, grad_var: float | None) -> float:
    """1.0 without noise statistics (nothing known: no batch is preferred on statistical grounds)."""
    if batch <= 0 or base_batch <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch} and {base_batch}")
    if grad_sqr is None or grad_var is None or grad_sqr <= 0:
        return 1.0
    scale = batch / base_batch
    return (grad_var + grad_sqr) / (grad_var / scale + grad_sqr) / scale


@dataclass(frozen=True)
class Choice:
    nodes: int
    replicas: int
    local_bsz: int
    accum_steps: int  # extra micro-steps per optimizer step (0: none)
    global_batch: int
    throughput: float  # samples/s
    goodput: float  # throughput × efficiency
    extrapolates: tuple[str, ...]


def best_config(
    model: ThroughputModel,
    *,
    gpus_per_node: int,
    nodes: range,
    global_batch: int,
    max_local_bsz: int,
    adaptive: tuple[int, int] | None = None,
    grad_sqr: float | None = None,
    grad_var: float | None = None,
) -> Choice:
    """The (nodes, local batch, accumulation) with the highest goodput. ``global_batch`` is kept exact
    (replicas × local batch × (accumulation + 1)) unless ``adaptive = (min, max)`` lets it vary, in
    which case ``global_batch`` is the batch the hyper-parameters were tuned for (M0)."""
    if not nodes or nodes.start < 1:
        raise ValueError(f"need a range of ≥ 1 nodes, got {nodes}")
    batches = _batches(global_batch, adaptive)
    best: Choice | None = None
    for n in nodes:
        replicas = n * gpus_per_node
        for batch in batches:
            for accum in range(0, batch // replicas):
                per_step = replicas * (accum + 1)
                if batch % per_step or batch // per_step > max_local_bsz:
                    continue
                local = batch // per_step
                tput = model.throughput(n, replicas, local, accum)
                good = tput * efficiency(batch, global_batch, grad_sqr, grad_var)
                if best is None or good > best.goodput * (1 + 1e-9):
                    warn = model.predict(n, replicas, local).extrapolates
                    best = Choice(n, replicas, local, accum, batch, tput, good, warn)
                break  # the least accumulation that fits is the fastest for this batch
    if best is None:
        raise ValueError(
            f"no configuration fits: global batch {global_batch} over {gpus_per_node} GPU(s) per node × {nodes} "
            f"with local batch ≤ {max_local_bsz} (use a batch divisible by the replica counts)"
        )
    return best


def _batches(global_batch: int, adaptive: tuple[int, int] | None) -> list[int]:
    if adaptive is None:
        return [global_batch]
    low, high = adaptive
    if not 0 < low <= global_batch <= high:
        raise ValueError(f"adaptive batch range {adaptive} must hold the base batch {global_batch}")
    steps = max(1, int(math.log2(high / low) * 4))  # quarter-octave grid
    return sorted({round(low * (high / low) ** (i / steps)) for i in range(steps + 1)} | {global_batch})

"""Goodput-driven allocation for the Pollux simulator: a fast greedy replacement for Pollux's
evolutionary search (theirs: NSGA-II, 100 generations × 100 states per interval, ~30 min a workload).

Both objectives are sums of per-job terms over GPU counts, so they are optimised by greedy marginal
allocation — hand out GPUs to the job whose cost drops most per GPU, looking ahead over the allowed
counts (1–4 on one node, then whole nodes) because speedup curves are not concave — under a node-
packing check. The placement then keeps every job whose count did not change where it was.

- ``pollux``: Pollux's objective. Speedup = believed goodput / goodput at a fair share of the
  cluster, damped by the restart penalty when the allocation changes; minimise Σ 1/(speedup + 10⁻³)
  (a power mean with p = −1: starving any job is very costly). A job may grow to at most twice the
  replicas it has run on (Pollux's exploration cap); NCF stays on one GPU as in the artifact.
- ``stalwart``: minimise average JCT directly. Each job is worth 1 / (its remaining time at the
  candidate allocation + the restart it costs): every reallocation is charged ``restart_cost_s`` of
  lost time, and short jobs are favoured (Smith's rule; a pretraining run knows its token budget).
"""

from __future__ import annotations

import math

import numpy as np

from stalwart.sched.pollux_goodput import belief, optimize_batch
from stalwart.sched.pollux_sim import NODES_GPUS, SimJob

_UNKNOWN_GRAD = (1.0, 0.0)  # no noise measured yet: a step at any batch counts as one base-batch step


class GoodputPolicy:
    def __init__(self, nodes: int, *, objective: str, restart_cost_s: float, interval_s: float) -> None:
        if objective not in ("pollux", "stalwart"):
            raise ValueError(f"objective must be 'pollux' or 'stalwart', got {objective!r}")
        self.nodes, self.gpus = nodes, nodes * NODES_GPUS
        self.objective = objective
        self.restart_cost_s = restart_cost_s
        self.interval_s = interval_s
        self.counts = np.array([0, 1, 2, 3, 4, *range(2 * NODES_GPUS, self.gpus + 1, NODES_GPUS)])
        self._memo: dict[str, tuple[tuple[object, ...], np.ndarray]] = {}

    def schedule(self, now: float, jobs: list[SimJob]) -> dict[str, tuple[int, ...]]:
        fair = math.ceil(self.gpus / len(jobs))
        cost = np.full((len(jobs), len(self.counts)), np.inf)
        for i, job in enumerate(jobs):
            cost[i] = self._cost(now, job, fair)
        chosen = greedy(cost, self.counts, self.nodes)
        return place(jobs, [int(self.counts[c]) for c in chosen], self.nodes)

    def _cap(self, job: SimJob) -> int:
        app = job.app
        cap = min(self.gpus, app.max_batch_size // app.min_local_bsz)
        if app.name == "ncf" and job.target_batch is not None:
            return 1
        if self.objective == "pollux":
            cap = min(cap, max(2 * job.max_seen_replicas, 1))
        return cap

    def _goodput(self, job: SimJob, counts: np.ndarray) -> np.ndarray:
        grad = job.grad or _UNKNOWN_GRAD
        key = (grad, tuple(counts))
        hit = self._memo.get(job.name)
        if hit is None or hit[0] != key:
            nodes = np.ceil(counts / NODES_GPUS)
            good = optimize_batch(belief(job.root, job.app.name), job.app, nodes, counts, grad)[0]
            self._memo[job.name] = hit = (key, good)
        return hit[1]

    def _cost(self, now: float, job: SimJob, fair: int) -> np.ndarray:
        out = np.full(len(self.counts), np.inf)
        ks = self.counts[1:][self.counts[1:] <= self._cap(job)]
        current = len(job.alloc)
        changed = ks != current
        if self.objective == "pollux":
            if job.grad is None:
                speed = ks / fair
            else:
                good = self._goodput(job, np.append(ks, fair))
                speed = good[:-1] / good[-1] if good[-1] > 0 else good[:-1] / max(good.max(), 1e-12)
            age, delay = now - job.spec.submit, self.restart_cost_s
            factor = max(age - max(job.starts - 1, 0) * delay, 0.0) / (age + delay) if age + delay > 0 else 1.0
            scaled = speed * np.where(changed, factor, 1.0) * self.nodes / self.gpus
            out[0] = 1.0 / 1e-3
            out[1 : 1 + len(ks)] = 1.0 / (scaled + 1e-3)
            return out
        remaining = max(job.app.target_progress - job.progress, 1e-9)
        good = self._goodput(job, ks)
        with np.errstate(divide="ignore"):
            finish = np.where(good > 0, remaining / good, np.inf)
        finish = finish + np.where(changed, self.restart_cost_s, job.restart_left)
        out[0] = 0.0
        out[1 : 1 + len(ks)] = -1.0 / finish
        return out


def nodes_needed(counts: list[int] | np.ndarray) -> int:
    """Nodes a set of GPU counts needs: multi-node jobs take whole nodes, the rest are bin-packed
    (first-fit decreasing, optimal for item sizes 1–4 in bins of 4)."""
    c = np.asarray(counts)
    whole = int(c[c > NODES_GPUS].sum()) // NODES_GPUS
    n1, n2, n3, n4 = (int((c == s).sum()) for s in (1, 2, 3, 4))
    bins = n4 + n3 + (n2 + 1) // 2
    holes = n3 + (2 if n2 % 2 else 0)
    return whole + bins + math.ceil(max(0, n1 - holes) / NODES_GPUS)


def greedy(cost: np.ndarray, counts: np.ndarray, nodes: int) -> np.ndarray:
    """Column per job (into ``counts``) minimising Σ cost: repeatedly the move from a job's current
    count to a larger one with the best cost drop per extra GPU, while the packing still fits."""
    cost = cost.copy()
    jobs = np.arange(len(cost))
    cur = np.zeros(len(cost), dtype=int)
    used, total = 0, nodes * NODES_GPUS
    while True:
        extra = counts[None, :] - counts[cur][:, None]
        with np.errstate(invalid="ignore"):
            drop = (cost[jobs, cur][:, None] - cost) / np.where(extra > 0, extra, 1)
        drop[(extra <= 0) | (extra > total - used) | ~np.isfinite(cost)] = -np.inf
        j, m = np.unravel_index(int(np.argmax(drop)), drop.shape)
        if not drop[j, m] > 0:
            return cur
        trial = counts[cur].copy()
        trial[j] = counts[m]
        if nodes_needed(trial[trial > 0]) > nodes:
            cost[j, m] = np.inf  # does not pack: never try this count for this job again this round
            continue
        used += int(counts[m] - counts[cur[j]])
        cur[j] = m


def place(jobs: list[SimJob], counts: list[int], nodes: int) -> dict[str, tuple[int, ...]]:
    """Node ids per GPU: jobs keeping their count stay put; the rest go, largest first, to whole free
    nodes (multi-node) or the fullest node they fit on. If keeping jobs in place leaves the free GPUs
    too fragmented, everything is re-packed; a job that still does not fit shrinks."""
    out = _try_place(jobs, counts, nodes, sticky=True)
    return out if out is not None else _try_place(jobs, counts, nodes, sticky=False) or {}


def _try_place(jobs: list[SimJob], counts: list[int], nodes: int, *, sticky: bool) -> dict[str, tuple[int, ...]] | None:
    free = np.full(nodes, NODES_GPUS)
    out: dict[str, tuple[int, ...]] = {}
    order = sorted(range(len(jobs)), key=lambda i: -counts[i])
    if sticky:
        for i in order:
            if counts[i] and len(jobs[i].alloc) == counts[i]:
                out[jobs[i].name] = jobs[i].alloc
                np.subtract.at(free, list(jobs[i].alloc), 1)
    for i in order:
        job, k = jobs[i], counts[i]
        if not k or job.name in out:
            continue
        got = _fit(free, k, job.alloc)
        while got is None and not sticky and k > 0:  # only after a full re-pack: shrink to fit
            k = k - 1 if k <= NODES_GPUS else k - NODES_GPUS
            got = _fit(free, k, job.alloc) if k else None
        if got is None:
            if sticky:
                return None
            continue
        out[job.name] = got
        np.subtract.at(free, list(got), 1)
    return out


def _fit(free: np.ndarray, k: int, previous: tuple[int, ...]) -> tuple[int, ...] | None:
    if k > NODES_GPUS:
        whole = [n for n in range(len(free)) if free[n] == NODES_GPUS]
        mine = sorted(set(previous) & set(whole))
        pick = (mine + [n for n in whole if n not in mine])[: k // NODES_GPUS]
        return tuple(n for n in sorted(pick) for _ in range(NODES_GPUS)) if len(pick) * NODES_GPUS == k else None
    fits = [n for n in range(len(free)) if free[n] >= k]
    if not fits:
        return None
    node = min(fits, key=lambda n: (n not in previous, free[n], n))
    return (node,) * k

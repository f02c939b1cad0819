"""The master's live autoscaler: how many nodes this job should run on, from what its nodes measure.

Every straggler window each agent reports its slowest local rank's median compute time per step
(``compute_s``) and the step time it saw (``step_s``). With the global batch fixed (stalwart's
default: accumulation keeps the sample order and the loss curve exact), DLRover's decomposition of a
synchronous step over the member set S gives

    T(S) = max_{i ∈ S} c_i · n / |S|  +  comm · ring(|S|) / ring(n),     ring(k) = 2 (k − 1) / k

where n is the current size, c_i node i's compute per step now (its share of the batch grows as n/|S|)
and comm = T(now) − max c_i the time no node computes (communication and waiting). For each size k
in [MIN, MAX] the best set keeps the k fastest nodes; the recommendation is the size with the
shortest predicted step (ties keep the current size). A size never observed is an extrapolation and is
reported as one.

With ``--autoscale on`` the master acts on a shrink through the eviction machinery (the slowest node
leaves, the others regroup from the newest in-memory snapshot), with hysteresis: the same
recommendation for ``confirm`` windows in a row, the predicted saving over ``horizon_s`` larger than
``restart_cost_s``, and at most one action per ``cooldown_s``. Growth needs no action: TorchElastic
admits a waiting spare at the next membership change while the job is below MAX.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from typing import Any

MODES = ("off", "recommend", "on")


@dataclass(frozen=True)
class AutoscalePolicy:
    mode: str = "recommend"  # off | recommend (status and /metrics) | on (also act on a shrink)
    restart_cost_s: float = 10.0  # what one regroup costs (benchmarks/recovery.py measures it)
    horizon_s: float = 600.0  # a change must pay back its restart cost within this much run time
    cooldown_s: float = 120.0  # at most one action per this many seconds
    confirm: int = 2  # windows in a row that must recommend the same size before acting
    stale_s: float = 30.0  # a node's window older than this does not count

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--autoscale must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.restart_cost_s < 0 or self.horizon_s <= 0 or self.cooldown_s < 0 or self.confirm < 1:
            raise ValueError(
                "autoscale needs restart cost ≥ 0, horizon > 0, cooldown ≥ 0 and confirm ≥ 1 "
                f"(got {self.restart_cost_s}, {self.horizon_s}, {self.cooldown_s}, {self.confirm})"
            )


@dataclass(frozen=True)
class Recommendation:
    current: int
    best: int
    step_s: dict[int, float]  # predicted step time per size
    keep: list[str]  # the nodes of the best size (the fastest)
    gain: float  # predicted throughput of the best size over the current one, minus 1
    extrapolated: list[int]  # sizes never observed in this job
    comm_s: float  # the measured time per step no node computes

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["step_s"] = {str(k): round(v, 6) for k, v in self.step_s.items()}
        return out


def ring(k: int) -> float:
    """The bandwidth term of a ring all-reduce over k members (0 for one: nothing to reduce)."""
    return 2.0 * (k - 1) / k if k > 1 else 0.0


def predict(compute_s: dict[str, float], step_s: float, sizes: list[int]) -> dict[int, tuple[float, list[str]]]:
    """size → (predicted step time, the nodes kept: the fastest), for a job now on ``compute_s``'s nodes."""
    n = len(compute_s)
    assert n >= 1, "predict needs at least one measured node"
    fastest = sorted(compute_s, key=lambda node: (compute_s[node], node))
    comm = max(0.0, step_s - max(compute_s.values()))
    out = {}
    for k in sizes:
        kept = fastest[: min(k, n)]
        compute = max(compute_s[i] for i in kept) * n / k
        out[k] = (compute + (comm * ring(k) / ring(n) if ring(n) else 0.0), kept)
    return out


@dataclass
class Autoscaler:
    policy: AutoscalePolicy = field(default_factory=AutoscalePolicy)
    _windows: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # node → (compute, step, time)
    _observed: set[int] = field(default_factory=set)  # sizes this job ran at
    _streak: tuple[int, int] = (0, 0)  # (recommended size, windows in a row)
    _last_action: float = float("-inf")
    _new: set[str] = field(default_factory=set)  # nodes with a window since the last recommendation
    _members: int = 1  # members at the last recommendation
    latest: Recommendation | None = None

    def observe(self, node: str, compute_s: float, step_s: float | None, now: float | None = None) -> None:
        if step_s is not None and step_s > 0 and compute_s == compute_s:
            self._windows[node] = (compute_s, step_s, time.time() if now is None else now)
            self._new.add(node)

    def forget(self, node: str) -> None:
        self._windows.pop(node, None)
        self._new.discard(node)

    def due(self) -> bool:
        """Whether enough new windows arrived for the next recommendation (one per window period,
        not one per heartbeat: hysteresis counts windows)."""
        now = time.time()
        fresh = sum(now - w[2] <= self.policy.stale_s for w in self._windows.values())
        return self.policy.mode != "off" and bool(self._new) and len(self._new) >= min(self._members, fresh)

    def recommend(
        self, members: list[str], min_nodes: int, max_nodes: int, spares: int = 0, now: float | None = None
    ) -> Recommendation | None:
        """The best size in [min_nodes, min(max_nodes, members + spares)], or None until every member
        has a fresh window."""
        now = time.time() if now is None else now
        fresh = {m: w for m in members if (w := self._windows.get(m)) is not None and now - w[2] <= self.policy.stale_s}
        if not members or len(fresh) < len(members) or not set(members) <= self._new:
            return None
        n = self._members = len(members)
        self._new.clear()
        self._observed.add(n)
        compute = {m: w[0] for m, w in fresh.items()}
        step = max(w[1] for w in fresh.values())  # synchronous: every member waits for the slowest
        top = max(min_nodes, min(max_nodes, n + spares))
        sizes = sorted({n, *range(max(1, min(min_nodes, n)), top + 1)})
        predicted = predict(compute, step, sizes)
        best = min(sizes, key=lambda k: (predicted[k][0], k != n, k))
        if predicted[best][0] >= predicted[n][0] * (1 - 1e-3):
            best = n  # within noise of the current size: stay
        rec = Recommendation(
            current=n,
            best=best,
            step_s={k: v[0] for k, v in predicted.items()},
            keep=predicted[best][1],
            gain=predicted[n][0] / predicted[best][0] - 1.0,
            extrapolated=[k for k in sizes if k not in self._observed],
            comm_s=max(0.0, step - max(compute.values())),
        )
        self._streak = (best, self._streak[1] + 1 if self._streak[0] == best else 1)
        self.latest = rec
        return rec

    def shrink_victim(self, rec: Recommendation, now: float | None = None) -> tuple[str, dict[str, Any]] | None:
        """The node to take out now under ``--autoscale on`` (the slowest of those the best size drops,
        one per action), with the numbers behind it; None while hysteresis holds the job as it is."""
        now = time.time() if now is None else now
        if self.policy.mode != "on" or rec.best >= rec.current or self._streak[0] != rec.best:
            return None
        saving_s = self.policy.horizon_s * (1.0 - rec.step_s[rec.best] / rec.step_s[rec.current])
        if self._streak[1] < self.policy.confirm or now - self._last_action < self.policy.cooldown_s:
            return None
        if saving_s <= self.policy.restart_cost_s:
            return None
        dropped = [m for m, _ in sorted(self._windows.items(), key=lambda kv: -kv[1][0]) if m not in rec.keep]
        if not dropped:
            return None
        self._last_action, self._streak = now, (0, 0)
        return dropped[0], {
            "cause": "autoscale",
            "current": rec.current,
            "best": rec.best,
            "gain": rec.gain,
            "saving_s": saving_s,
            "restart_cost_s": self.policy.restart_cost_s,
            "step_s": rec.to_dict()["step_s"],
        }


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The master's autoscaler flags (shared by `stalwart master` and the in-process master of `run`)."""
    parser.add_argument(
        "--autoscale",
        choices=MODES,
        default="recommend",
        help="recommend a node count within --nnodes MIN:MAX from the nodes' measured compute and step "
        "times (status, /metrics); `on` also shrinks the job (the slowest node leaves) when the model "
        "says fewer nodes train faster; off: neither (default recommend)",
    )
    parser.add_argument(
        "--autoscale-restart-cost",
        type=float,
        default=10.0,
        help="seconds one regroup costs; a change must save more than this within the horizon (default 10)",
    )
    parser.add_argument(
        "--autoscale-horizon",
        type=float,
        default=600.0,
        help="seconds of run time a change is credited with (default 600)",
    )
    parser.add_argument(
        "--autoscale-cooldown",
        type=float,
        default=120.0,
        help="at most one autoscale action per this many seconds (default 120)",
    )


def from_args(args: argparse.Namespace) -> Autoscaler:
    return Autoscaler(
        AutoscalePolicy(args.autoscale, args.autoscale_restart_cost, args.autoscale_horizon, args.autoscale_cooldown)
    )

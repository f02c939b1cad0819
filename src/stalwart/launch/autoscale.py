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

With ``--autoscale on`` the master acts, one node per action: a shrink parks the slowest node the
best size drops (it steps out of the rendezvous and waits as a spare: ``park``; the others regroup from
the newest snapshot), a grow unparks the fastest parked node the best size adds (judged by its last
windows). Hysteresis: a node counts as the fastest of its last ``smooth`` windows at the current
membership (noise on a shared host only adds time: a node slowed by a neighbour's burst for fewer
windows is not judged by it; CI saw a node parked on two such windows and unparked at once), and a
membership change starts every member's windows afresh; the same recommendation for ``confirm``
windows in a row once every member has ``smooth`` windows, the predicted saving over ``horizon_s``
larger than ``restart_cost_s``, and at most one action per ``cooldown_s``. Spares
waiting at the rendezvous need no action: TorchElastic admits them at the next membership change.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import Collection
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
    smooth: int = 3  # a node's compute and step: the fastest of this many of its latest windows

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--autoscale must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.restart_cost_s < 0 or self.horizon_s <= 0 or self.cooldown_s < 0 or self.confirm < 1 or self.smooth < 1:
            raise ValueError(
                "autoscale needs restart cost ≥ 0, horizon > 0, cooldown ≥ 0, confirm ≥ 1 and smooth ≥ 1 "
                f"(got {self.restart_cost_s}, {self.horizon_s}, {self.cooldown_s}, {self.confirm}, {self.smooth})"
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


def predict(
    compute_s: dict[str, float], step_s: float, sizes: list[int], spares: dict[str, float | None] | None = None
) -> dict[int, tuple[float, list[str]]]:
    """size → (predicted step time, the nodes kept), for a job now on ``compute_s``'s nodes: the fastest
    members for a smaller size; for a larger one, the members and the fastest spares (a spare's compute
    as last measured, e.g. before it was parked; never measured: the members' median)."""
    n = len(compute_s)
    assert n >= 1, "predict needs at least one measured node"
    fastest = sorted(compute_s, key=lambda node: (compute_s[node], node))
    typical = sorted(compute_s.values())[n // 2]
    extra = {s: typical if c is None else c for s, c in (spares or {}).items()}
    joiners = sorted(extra, key=lambda node: (extra[node], node))
    every = {**extra, **compute_s}
    comm = max(0.0, step_s - max(compute_s.values()))
    out = {}
    for k in sizes:
        kept = fastest[:k] if k <= n else fastest + joiners[: k - n]
        compute = max(every[i] for i in kept) * n / len(kept)
        out[k] = (compute + (comm * ring(len(kept)) / ring(n) if ring(n) else 0.0), kept)
    return out


@dataclass
class Autoscaler:
    policy: AutoscalePolicy = field(default_factory=AutoscalePolicy)
    _windows: dict[str, deque[tuple[float, float, float]]] = field(default_factory=dict)  # node → (compute, step, t)…
    _membership: frozenset[str] = frozenset()  # the members at the last recommendation
    _observed: set[int] = field(default_factory=set)  # sizes this job ran at
    _streak: tuple[int, int] = (0, 0)  # (recommended size, windows in a row)
    _last_action: float = float("-inf")
    _new: set[str] = field(default_factory=set)  # nodes with a window since the last recommendation
    _members: int = 1  # members at the last recommendation
    _last_rec: float = float("-inf")  # wall clock of the last recommendation
    _period: float = 1.0  # the gap between two windows of one node (the window period), smoothed
    latest: Recommendation | None = None

    def observe(self, node: str, compute_s: float, step_s: float | None, now: float | None = None) -> None:
        if step_s is not None and step_s > 0 and compute_s == compute_s:
            now = time.time() if now is None else now
            history = self._windows.setdefault(node, deque(maxlen=self.policy.smooth))
            if history and now - history[-1][2] > 1e-3:
                self._period = 0.8 * self._period + 0.2 * (now - history[-1][2])  # smoothed: one late window is noise
            history.append((compute_s, step_s, now))
            self._new.add(node)

    def _smoothed(self, node: str) -> tuple[float, float] | None:
        """(compute, step): the fastest of the node's latest windows, None if it has none."""
        history = self._windows.get(node)
        if not history:
            return None
        return min(w[0] for w in history), min(w[1] for w in history)

    def forget(self, node: str) -> None:
        self._windows.pop(node, None)
        self._new.discard(node)

    def due(self) -> bool:
        """A cheap gate before the master reads its node table: as many new windows as there were
        members at the last recommendation (one recommendation per window period, not per heartbeat:
        hysteresis counts windows), or two periods without one (a member left: parked, evicted, lost)."""
        if self.policy.mode == "off" or not self._new:
            return False
        return len(self._new) >= self._members or time.time() - self._last_rec > 2 * self._period

    def recommend(
        self, members: list[str], min_nodes: int, max_nodes: int, spares: list[str] = (), now: float | None = None
    ) -> Recommendation | None:
        """The best size in [min_nodes, min(max_nodes, members + spares)], or None until every member
        has a fresh window (spares: waiting or parked nodes, judged by their last window if any)."""
        now = time.time() if now is None else now
        fresh = [m for m in members if (h := self._windows.get(m)) and now - h[-1][2] <= self.policy.stale_s]
        if not members or len(fresh) < len(members) or not set(members) <= self._new:
            return None
        n = self._members = len(members)
        self._new.clear()
        self._last_rec = now
        if frozenset(members) != self._membership:  # a regroup changes every member's share: start over
            first, self._membership, self._streak = not self._membership, frozenset(members), (0, 0)
            if not first:
                for m in members:  # these windows may be the old membership's: wait for the next ones
                    self._windows[m].clear()
                return None
        for m in members:  # a node that stalled and came back: its windows from before do not count
            history = self._windows[m]
            while now - history[0][2] > self.policy.stale_s:
                history.popleft()
        self._observed.add(n)
        smoothed = {m: self._smoothed(m) for m in members}
        compute = {m: w[0] for m, w in smoothed.items()}
        step = max(w[1] for w in smoothed.values())  # synchronous: every member waits for the slowest
        top = max(min_nodes, min(max_nodes, n + len(spares)))
        sizes = sorted({n, *range(max(1, min(min_nodes, n)), top + 1)})
        predicted = predict(compute, step, sizes, {s: (self._smoothed(s) or (None,))[0] for s in spares})
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
        if all(len(self._windows[m]) >= self.policy.smooth for m in members):  # only whole histories count
            self._streak = (best, self._streak[1] + 1 if self._streak[0] == best else 1)
        else:
            self._streak = (0, 0)
        self.latest = rec
        return rec

    def action(
        self, rec: Recommendation, members: list[str], now: float | None = None, parked: Collection[str] = ()
    ) -> tuple[str, str, dict[str, Any]] | None:
        """Under ``--autoscale on``: ("park", the slowest node the best size drops) to shrink, or
        ("unpark", the fastest ``parked`` node it adds) to grow — one node per action — with the numbers
        behind it; None while hysteresis holds the job as it is. Only a parked node is unparked: a member
        that is restarting is briefly no member (CI saw one "unparked" mid-regroup)."""
        now = time.time() if now is None else now
        if self.policy.mode != "on" or rec.best == rec.current or self._streak[0] != rec.best:
            return None
        saving_s = self.policy.horizon_s * (1.0 - rec.step_s[rec.best] / rec.step_s[rec.current])
        if self._streak[1] < self.policy.confirm or now - self._last_action < self.policy.cooldown_s:
            return None
        if saving_s <= self.policy.restart_cost_s:
            return None
        if rec.best < rec.current:
            kind = "park"
            chosen = [m for m in sorted(members, key=lambda m: -self._smoothed(m)[0]) if m not in rec.keep]
        else:
            kind, chosen = "unpark", [s for s in rec.keep if s not in members and s in parked]
        if not chosen:
            return None
        self._last_action, self._streak = now, (0, 0)
        return (
            kind,
            chosen[0],
            {
                "cause": "autoscale",
                "current": rec.current,
                "best": rec.best,
                "gain": rec.gain,
                "saving_s": saving_s,
                "restart_cost_s": self.policy.restart_cost_s,
                "step_s": rec.to_dict()["step_s"],
            },
        )


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The master's autoscaler flags (shared by `stalwart master` and the in-process master of `run`)."""
    parser.add_argument(
        "--autoscale",
        choices=MODES,
        default="recommend",
        help="recommend a node count within --nnodes MIN:MAX from the nodes' measured compute and step "
        "times (status, /metrics); `on` also acts: parks the slowest node (it waits as a spare) when fewer "
        "nodes train faster and unparks it when more do; off: neither (default recommend)",
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

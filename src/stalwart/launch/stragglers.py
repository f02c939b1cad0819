"""Straggler detection at the master: compare nodes' compute time per step over windows.

Synchronous training paces every rank to the slowest, so step rate cannot reveal a slow node; the
time a node spends on its own work (no communication wait) can. Each agent reports, per window, the
median compute seconds per step of its slowest local rank. A node whose value exceeds `threshold` ×
the median of the other nodes for `k` consecutive windows is flagged (MegaScale found 0.5 % of
machines slow enough to matter; one noisy window must not be enough).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class StragglerDetector:
    threshold: float = 1.3
    k: int = 3
    stale_s: float = 30.0  # ignore nodes whose last window is older than this
    _latest: dict[str, tuple[float, float]] = field(default_factory=dict)  # node → (value, time)
    _strikes: dict[str, int] = field(default_factory=dict)
    flagged: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.threshold <= 1.0 or self.k < 1:
            raise ValueError(f"straggler threshold must be > 1 and k ≥ 1 (got {self.threshold}, {self.k})")

    def observe(self, node: str, compute_s: float, now: float | None = None) -> tuple[bool, float | None]:
        """Record one window of `node`; returns (newly flagged, ratio to the other nodes' median)."""
        now = time.time() if now is None else now
        self._latest[node] = (compute_s, now)
        others = [v for n, (v, t) in self._latest.items() if n != node and now - t <= self.stale_s]
        if not others or compute_s != compute_s:  # no peers yet, or NaN
            return False, None
        ratio = compute_s / max(statistics.median(others), 1e-12)
        self._strikes[node] = self._strikes.get(node, 0) + 1 if ratio > self.threshold else 0
        if self._strikes[node] >= self.k and node not in self.flagged:
            self.flagged.add(node)
            return True, ratio
        if self._strikes[node] == 0:
            self.flagged.discard(node)  # recovered
        return False, ratio

    def forget(self, node: str) -> None:
        """Drop a node that left the job: its last window must not skew the others' median."""
        self._latest.pop(node, None)
        self._strikes.pop(node, None)
        self.flagged.discard(node)


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The master's straggler flags (shared by `stalwart master` and the in-process master of `run`)."""
    parser.add_argument(
        "--straggler-threshold",
        type=float,
        default=1.3,
        help="a node this × slower (compute per step) than the others' median is slow (default 1.3)",
    )
    parser.add_argument(
        "--straggler-windows", type=int, default=3, help="consecutive slow windows before a node is flagged (default 3)"
    )


def from_args(args: argparse.Namespace) -> StragglerDetector:
    return StragglerDetector(args.straggler_threshold, args.straggler_windows)

"""When the master takes a node out of the job, and who can take its place.

Agents tell the master with every heartbeat whether their workers are in the current rendezvous round
(``member``). An agent that joined the master and beats but is not a member is a *spare*: with
``--nnodes MIN:MAX`` TorchElastic's c10d rendezvous keeps agents beyond MAX waiting (its "redundancy
list") and admits them in the next round, so evicting a member makes a waiting spare take its place.

Evicting costs a regroup (every member restarts from the last checkpoint), so the rules are:
  - a failed precheck always evicts: the node would poison the job;
  - a straggler (flagged for K windows) is evicted only with ``--straggler-policy evict`` and a spare
    waiting: without one, losing a slow node loses more throughput than it wins;
  - a node that caused ``--evict-after-failures`` failures is evicted when the job keeps ≥ MIN nodes
    (members left plus spares).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

POLICIES = ("warn", "evict")


@dataclass(frozen=True)
class EvictionPolicy:
    stragglers: str = "warn"  # warn | evict (with a spare waiting)
    after_failures: int = 0  # evict a node after this many failures it caused (0 = never)
    precheck_slow_factor: float = 2.0  # precheck matmul × the other nodes' median = slow node
    fresh_s: float = 5.0  # a node counts (member or spare) only with a heartbeat this recent

    def __post_init__(self) -> None:
        if self.stragglers not in POLICIES:
            raise ValueError(f"straggler policy must be one of {', '.join(POLICIES)}, got {self.stragglers!r}")
        if self.after_failures < 0:
            raise ValueError(f"--evict-after-failures must be ≥ 0 (0 = never), got {self.after_failures}")
        if self.precheck_slow_factor <= 1.0:
            raise ValueError(f"precheck slow factor must be > 1, got {self.precheck_slow_factor}")


def _fresh(node: dict[str, Any], now: float, fresh_s: float) -> bool:
    return node["state"] == "alive" and now - node["last_heartbeat"] <= fresh_s


def members(nodes: list[dict[str, Any]], now: float | None = None, fresh_s: float = 5.0) -> list[str]:
    """Nodes whose workers are in the current round."""
    now = time.time() if now is None else now
    return [n["node_id"] for n in nodes if _fresh(n, now, fresh_s) and n["progress"].get("member") is True]


def spares(nodes: list[dict[str, Any]], now: float | None = None, fresh_s: float = 5.0) -> list[str]:
    """Nodes that beat but wait outside a running round. None while no round runs (at the start, or
    while every member regroups): then nobody is waiting *beside* the job, everyone is joining it. A
    member of the running round that already waits to regroup (its ``round`` is the members' newest)
    is no spare either: it goes on with the job."""
    now = time.time() if now is None else now
    running = [n for n in nodes if n["node_id"] in members(nodes, now, fresh_s)]
    if not running:
        return []
    current = max((n["progress"].get("round") for n in running if n["progress"].get("round") is not None), default=None)
    return [
        n["node_id"]
        for n in nodes
        if _fresh(n, now, fresh_s)
        and n["progress"].get("member") is False
        and (current is None or n["progress"].get("round") != current)
    ]


def precheck_ratio(matmul_s: float, others: list[float]) -> float | None:
    """This node's precheck time over the median of the other nodes' (None without peers)."""
    others = [o for o in others if o > 0]
    if not others or matmul_s <= 0:
        return None
    return matmul_s / statistics.median(others)


def keeps_minimum(nodes: list[dict[str, Any]], leaving: str, now: float | None = None, fresh_s: float = 5.0) -> bool:
    """Whether the job still has ≥ MIN nodes (members and spares) without `leaving`. MIN comes from
    the agents' join info (``--nnodes MIN:MAX``); unknown counts as 1."""
    now = time.time() if now is None else now
    min_nodes = max((int(n["info"].get("min_nodes") or 1) for n in nodes), default=1)
    left = [n for n in members(nodes, now, fresh_s) + spares(nodes, now, fresh_s) if n != leaving]
    return len(left) >= min_nodes


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The master's eviction flags (shared by `stalwart master` and the in-process master of `run`)."""
    parser.add_argument(
        "--straggler-policy",
        choices=POLICIES,
        default="warn",
        help="what a flagged straggler gets: warn (journal only), or evict when a spare agent "
        "waits to take its place (default warn)",
    )
    parser.add_argument(
        "--evict-after-failures",
        type=int,
        default=0,
        help="evict a node after this many failures it caused, if ≥ MIN nodes remain (default 0 = never)",
    )


def from_args(args: argparse.Namespace) -> EvictionPolicy:
    return EvictionPolicy(args.straggler_policy, args.evict_after_failures)

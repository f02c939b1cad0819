"""The simulated job's ranks and nodes, as plain data (``sim.World`` moves them)."""

from __future__ import annotations

from dataclasses import dataclass, field

Key = tuple[int, int]  # (step, epoch): a snapshot


@dataclass
class Rank:
    rank: int
    node: str
    alive: bool = True
    trained: int = 0  # the last step trained (the restored step after a restart)
    copying: int | None = None  # the slot being written, torn until published
    slots: list[Key | None] = field(default_factory=lambda: [None, None])
    taken: list[float] = field(default_factory=lambda: [0.0, 0.0])  # capture time by the node's clock


@dataclass
class Node:
    name: str
    ranks: list[int]
    skew: float = 0.0  # this node's clock minus true time
    up: bool = True
    keeper_up: bool = True
    incarnation: int = 0
    seq: int = 0
    pins: dict[Key, int] = field(default_factory=dict)  # key → the newest plan that pinned it (0: on sight)
    sight: Key | None = None  # the one step pinned on sight, until its release
    task: tuple[int, int, Key] | None = None  # (plan, attempt, key) whose shards it writes
    mine: list[int] = field(default_factory=list)  # the task's ranks (writers), written on its Write
    todo: list[int] = field(default_factory=list)  # ranks whose shards are still to write
    commits: list[tuple[int, int]] = field(default_factory=list)  # (plan, step) it commits (writes rank 0)
    stopped: bool = False  # its workers of the current epoch are gone
    dead_epoch: int | None = None  # its dead workers' execution, until the next ones replace their records
    last_plan: tuple[int, int] = (0, 0)  # the newest (plan, attempt) it acted on
    cursor: tuple[int, int, float] | None = None  # old design: (step, epoch, taken) it began on its own
    copies: dict[int, list[Key | None]] = field(default_factory=dict)  # another node's rank → 2 replica slots
    pushed: dict[int, Key] = field(default_factory=dict)  # own rank → the newest key copied to the peer


def published(rank: Rank) -> list[Key]:
    """The rank's complete snapshots (not the slot being copied into)."""
    return [k for i, k in enumerate(rank.slots) if k is not None and rank.copying != i]

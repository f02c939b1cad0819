"""What the checkpoint decider hears and says (docs/protocol.md): frozen dataclasses, no I/O. A snapshot's
*key* is ``(step, epoch)``, the epoch being the execution that took it: a step redone after a restart is a new key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Key = tuple[int, int]  # (step, epoch) of a snapshot
Held = tuple[tuple[int, int, tuple[int, ...], bool], ...]  # (step, epoch, ranks holding it, pinned)
# A node's ranks are its own and those of other nodes whose snapshots it holds as peer copies (replicas).


# -- events -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Holding:
    """A keeper's full report of what its node holds now. ``(incarnation, seq)`` orders reports: an
    older one (late, duplicated) is ignored; a higher incarnation means the keeper was restarted."""

    node: str
    incarnation: int
    seq: int
    held: Held


@dataclass(frozen=True)
class PersistDue:
    """Step ``step`` of execution ``epoch`` is flagged for persistence (every rank's header says so)."""

    step: int
    epoch: int


@dataclass(frozen=True)
class Pinned:
    """The node pinned its ranks' snapshots for ``attempt`` of plan ``plan`` (``ok``), or does not hold
    them. A pin of an earlier attempt does not count: the retry's ``Write`` must come after the node
    took up the retry (a restarted keeper pins anew)."""

    node: str
    plan: int
    ok: bool
    reason: str = ""
    attempt: int = 1


@dataclass(frozen=True)
class Wrote:
    """The node wrote (and fsynced) its ranks' shards for ``attempt`` of plan ``plan`` (``ok``), or
    failed to. Only the current attempt counts: an earlier one's shards may have been rewritten since."""

    node: str
    plan: int
    attempt: int
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Committed:
    """The commit of plan ``plan`` (.metadata → manifest → latest) finished (``ok``) or failed."""

    plan: int
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class WorkersGone:
    """Every worker of ``node`` in execution ``epoch`` is gone (failure, or stopped for one): ``held`` is
    the node's final holdings of that execution, read after its workers died."""

    node: str
    epoch: int
    held: Held


@dataclass(frozen=True)
class NodeLost:
    """Membership (the master's presence, the rendezvous) lost ``node`` during ``epoch``."""

    node: str
    epoch: int


@dataclass(frozen=True)
class Preempted:
    """A preemption notice for the job during ``epoch``: stop, save, end."""

    epoch: int


@dataclass(frozen=True)
class EpochBegan:
    """A rendezvous round: execution ``epoch`` began with ``nodes`` (node → its ranks)."""

    epoch: int
    nodes: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class RolledBack:
    """A training-health rollback during ``epoch`` deleted the committed steps after ``latest`` (-1:
    none is left): the redone steps, under the same numbers, are persisted again."""

    epoch: int
    latest: int


@dataclass(frozen=True)
class JobEnded:
    """The job is over (finished, failed for good, or preempted)."""


Event = Holding | PersistDue | Pinned | Wrote | Committed | WorkersGone | NodeLost | Preempted | EpochBegan
Event = Event | RolledBack | JobEnded


# -- decisions --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Persist:
    """Every node in ``nodes``: pin the snapshots ``key`` of the ranks ``writers`` gives you (your own,
    and a lost node's whose copies you hold), say so, write their shards for ``attempt`` and say so.
    ``failure``: this is the save-on-failure of execution ``key[1]``'s end."""

    plan: int
    key: Key
    attempt: int
    nodes: tuple[str, ...]
    epoch: int
    failure: bool = False
    writers: tuple[tuple[str, tuple[int, ...]], ...] = ()  # node → the ranks it writes


@dataclass(frozen=True)
class Write:
    """Every node of plan ``plan`` pinned ``key`` and put its ranks' entry tables beside the step: each now
    plans the same global layout from all of them and writes its ranks' shards for ``attempt``."""

    plan: int
    key: Key
    attempt: int
    epoch: int


def committer(writers: dict[str, Any]) -> str:
    """The node that commits a plan: the one writing rank 0 (its own node, or a survivor's copy)."""
    return next(n for n, ranks in sorted(writers.items()) if 0 in ranks)


@dataclass(frozen=True)
class Commit:
    """Every rank's shards of ``plan`` are written: .metadata → manifest → latest, for ``step``."""

    plan: int
    step: int
    epoch: int


@dataclass(frozen=True)
class GiveUp:
    """Step ``step`` will not be persisted (``why``); plan None: it never started."""

    plan: int | None
    step: int
    why: str
    epoch: int


@dataclass(frozen=True)
class Release:
    """``node`` (every node when None): unpin ``key`` (every key when None) where plan ``upto`` or an
    earlier one pinned it — a pin of a later plan (this word came late) stays; ``free``: drop the
    snapshots too (the job ended)."""

    node: str | None
    key: Key | None
    upto: int
    epoch: int
    free: bool = False


@dataclass(frozen=True)
class RestartMayProceed:
    """The failed execution ``failed_epoch`` may be restarted: every node holds ``key`` pinned (the
    restarted ranks restore it from memory), or ``key`` None: nothing of it can be saved (``why``)."""

    failed_epoch: int
    key: Key | None
    why: str


Decision = Persist | Write | Commit | GiveUp | Release | RestartMayProceed

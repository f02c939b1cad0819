"""The coordination records of a multi-node persist, small JSON files in the checkpoint storage's
``.stage/``: each node's entry tables and cursor, the coordinator's request, rank 0's node's failure
and settle records (epochs, never clocks). :mod:`.multinode` runs the protocol over them; issue 30's
decider (``decider.py``) is to replace them, so they live in this one module.
"""

from __future__ import annotations

import json
import time
from typing import Any

from stalwart.checkpoint.persist import json_bytes
from stalwart.checkpoint.storage import Storage, step_name

STAGE = ".stage"
REQUEST = "request.json"
SETTLED = "settled.json"
FAILURE = "failure.json"


class MissingSnapshot(LookupError):
    """A node no longer holds the step asked for (overwritten, or its workers never reached it)."""


class Abandoned(MissingSnapshot):
    """This node's snapshot of the step belongs to an execution that failed before rank 0's node held
    the step: no node can persist it (``declare_failure``)."""


# -- small JSON files in storage ------------------------------------------------------------------
def put(storage: Storage, obj: Any, *parts: str) -> None:
    if storage.local:
        storage.fs.makedirs(storage.path(*parts[:-1]), exist_ok=True)
    storage.write_atomic(json_bytes(obj), *parts)


def get(storage: Storage, *parts: str) -> Any:
    text = storage.read_text(*parts)
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:  # an object store never shows half a PUT; a local rename neither
        return None


def stage_of(step: int, *parts: str) -> tuple[str, ...]:
    return (STAGE, step_name(step), *parts)


def remove(storage: Storage, *parts: str) -> None:
    try:
        storage.fs.rm(storage.path(*parts), recursive=True)
    except FileNotFoundError:
        pass


def clear_stage(storage: Storage, below: int) -> None:
    """Remove the stage files of every step below ``below`` (finished: committed or superseded)."""
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(storage.path(STAGE), detail=False)]
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith("step-") and int(name[5:]) < below:
            remove(storage, STAGE, name)


def forget_after(storage: Storage, step: int) -> None:
    """A rollback to ``step``: the nodes' cursors, the open request and the stage of every later step
    belong to the abandoned trajectory. Left, a cursor "moved on" past a redone step would make the
    coordinator give that step up, and a stale request would start a persist nobody joins."""
    remove(storage, STAGE, "cursor")
    remove(storage, STAGE, REQUEST)
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in storage.fs.ls(storage.path(STAGE), detail=False)]
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith("step-") and name[5:].isdigit() and int(name[5:]) > step:
            remove(storage, STAGE, name)


def request(storage: Storage, step: int) -> None:
    """Ask every node to take part in persisting ``step`` (coordinator only)."""
    put(storage, {"step": step, "time": time.time()}, STAGE, REQUEST)


def requested_step(storage: Storage) -> int | None:
    req = get(storage, STAGE, REQUEST)
    return int(req["step"]) if req else None


def settle(storage: Storage, epoch: int, step: int | None, detail: str) -> None:
    """Rank 0's node has finished a save-on-failure for the execution ``epoch``: ``step`` (the newest step
    every rank holds) is durable, or None when no step could be made so (it failed, or no step was
    held by all). The only word a node that waits for that save (a preemption: it must keep its keeper
    up while its shards may be asked for) has that the save is over, when the step it holds itself is
    newer than the one every rank holds."""
    put(storage, {"step": step, "detail": detail, "epoch": epoch}, STAGE, SETTLED)


def settled(storage: Storage, epoch: int) -> dict[str, Any] | None:
    """The newest save-on-failure's outcome, if it was for the execution ``epoch`` or a later one (a
    save for an earlier execution's fault may finish after a notice and say nothing about it). Epochs,
    not times: the nodes' clocks need not agree."""
    record = get(storage, STAGE, SETTLED)
    return record if record and int(record.get("epoch", -1)) >= epoch else None


def answer_missing(storage: Storage, step: int, ranks: list[int], why: str) -> None:
    for r in ranks:
        put(storage, {"missing": why}, *stage_of(step, "plans", f"rank{r}.json"))


def declare_failure(storage: Storage, epoch: int, newest: int) -> None:
    """Execution ``epoch`` failed, and rank 0's node, its workers gone, will never hold a step of it
    above ``newest``. A later step's snapshot of that execution (or an earlier one) is a dead end: a
    node persisting it waits for a plan that can never come, and its cursor would make every older step
    look missing. The same step redone after the restart belongs to a later execution and is persisted.
    An integer comparison, valid whatever the nodes' clocks say."""
    put(storage, {"epoch": epoch, "newest": newest}, STAGE, FAILURE)


def forget_records_from(storage: Storage, epoch: int) -> list[str]:
    """Before execution ``epoch`` restores (rank 0): remove the failure and settle records that name it
    or a later one. Within a launch they cannot exist yet (an execution's failure is declared before the
    next one restores); they are an earlier launch's, whose rendezvous rounds started at 0 again, and
    would make this launch's snapshots dead ends and its preemptions settled at once. Returns what went."""
    gone = []
    for name in (FAILURE, SETTLED):
        record = get(storage, STAGE, name)
        if record is not None and int(record.get("epoch", -1)) >= epoch:
            remove(storage, STAGE, name)
            gone.append(name)
    return gone


def dead_end(storage: Storage, step: int, epoch: int | None) -> dict[str, Any] | None:
    """The declared failure that makes this snapshot (``step`` of execution ``epoch``) a dead end, if any."""
    if epoch is None:
        return None
    failure = get(storage, STAGE, FAILURE)
    if failure and step > int(failure["newest"]) and epoch <= int(failure.get("epoch", -1)):
        return failure
    return None


def raise_if_dead_end(storage: Storage, step: int, epoch: int | None) -> None:
    if (failure := dead_end(storage, step, epoch)) is not None:
        raise Abandoned(
            f"step {step} is a dead end: rank 0's node failed holding steps up to {failure['newest']} "
            "and saves one of those"
        )


def cursor(storage: Storage, rank: int) -> dict[str, Any] | None:
    """The step ``rank``'s node last began to persist, and the execution its snapshot of it belongs to."""
    return get(storage, STAGE, "cursor", f"rank{rank}.json")


def moved_on(storage: Storage, rank: int, step: int) -> dict[str, Any] | None:
    """A "missing" answer when ``rank``'s node has started persisting a later step than ``step`` (not a
    dead end: its keeper comes back from one)."""
    at = cursor(storage, rank)
    if at and int(at["step"]) > step and not dead_end(storage, int(at["step"]), at.get("epoch")):
        return {"missing": f"its keeper moved on to step {at['step']}"}
    return None


def table(storage: Storage, rank: int, step: int) -> dict[str, Any] | None:
    """Rank ``rank``'s entry table for ``step`` (not one of a dead-end snapshot, left by a failed
    execution of the step), or a "missing" answer."""
    found = get(storage, *stage_of(step, "plans", f"rank{rank}.json"))
    if found is not None and ("missing" in found or not dead_end(storage, step, found.get("epoch"))):
        return found
    return moved_on(storage, rank, step)

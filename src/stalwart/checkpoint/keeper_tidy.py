"""What a keeper removes from storage that no checkpoint needs: torn step directories (a persist that
died, a plan given up mid-write) and failed attempts whose removal failed while storage was down."""

from __future__ import annotations

import logging
from collections.abc import Callable

from stalwart.checkpoint.node_job import NodeJob
from stalwart.checkpoint.persist import remove_torn
from stalwart.checkpoint.storage import Storage, step_name
from stalwart.checkpoint.storage_health import StorageHealth

Event = Callable[..., None]  # the keeper's event(kind, step, detail, level)


def tidy_storage(node: NodeJob, storage: Storage, event: Event, health: StorageHealth, across: bool = False) -> None:
    """At the keeper's start (rank 0's node): torn step directories are never resumed from; remove them.
    ``across`` (a job across nodes): only those older than ``latest`` — a newer one may be a plan that
    other nodes' keepers are writing now (this keeper may be a spare's, joining mid-save), which the
    decider's ``GiveUp`` tidies if it fails; the node-local persist lock does not cover them."""
    try:
        with node.persist_lock():
            latest = storage.latest()
            below = (latest if latest is not None else -1) if across else None
            for s in storage.remove_uncommitted(below):
                why = f"{step_name(s)} had no manifest (a persist died mid-write; latest is {latest})"
                event("removed-torn", s, why, logging.WARNING)
    except Exception as err:  # unreachable storage: the first persist will report it too
        health.failed("tidy", None, err)


def remove_leftovers(storage: Storage, leftovers: set[int], event: Event) -> None:
    """Storage works again: remove the failed attempts that could not be removed when they failed."""
    for step in sorted(leftovers):
        if remove_torn(storage, step):
            leftovers.discard(step)
            event("removed-torn", step, "a failed attempt, removed now that storage works again")

"""A training-health rollback of a :class:`~stalwart.checkpoint.checkpointer.Checkpointer`: restore the
newest checkpoint at or before a step and delete everything newer (memory and storage), so no later
restore can resume the abandoned trajectory."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from stalwart.checkpoint.restore import RestoreInfo, candidates, restore_state
from stalwart.checkpoint.shm import complete_slots

if TYPE_CHECKING:
    from stalwart.checkpoint.checkpointer import Checkpointer

log = logging.getLogger("stalwart.checkpoint")


def roll_back(ck: Checkpointer, state: dict[str, Any], at_most: int, before: int) -> RestoreInfo:
    """Load the newest checkpoint at step ≤ ``at_most`` (memory or storage) into ``state`` — or, when
    there is none yet, the oldest one before ``before`` (``info.detail`` says so). Snapshots and
    committed checkpoints newer than the restored step belong to the abandoned trajectory and are
    deleted. Raises LookupError when nothing can be restored. Collective: every rank must call it."""
    ck.writer.wait()
    if ck.pending_persist is not None and ck.use_keeper:
        try:  # let the keeper finish what was requested: it may be the step we need
            ck.keeper.wait_persisted(ck.pending_persist)
            ck.pending_persist = None
        except RuntimeError as err:
            log.warning("rollback: %s; choosing among committed checkpoints", err)
    memory, committed = candidates(  # gathers: every rank's wait is over before rank 0 deletes anything
        ck.paths, ck.storage, ck.rank, ck.world, ck.group
    )
    steps = sorted({*memory, *committed} - {s for s in committed if s >= before})
    eligible = [s for s in steps if s <= at_most]
    target = eligible[-1] if eligible else (steps[0] if steps and steps[0] < before else None)
    held = f"memory holds {memory or 'nothing'}, storage {committed or 'nothing'}"
    if target is None:
        raise LookupError(f"no checkpoint before step {before} to roll back to ({held})")
    info = restore_state(
        ck._bind(state),
        ck.paths,
        ck.storage,
        ck.rank,
        ck.world,
        ck.group,
        max_step=target,
        trajectory=ck._next_trajectory(),
    )
    if info.source == "fresh":
        raise LookupError(f"no usable checkpoint ≤ step {target} ({held}): {'; '.join(info.skipped)}")
    if not eligible:
        info.detail += f" (the oldest held: none is at or before step {at_most} yet)"
    if ck.pending_persist is not None and ck.pending_persist > info.step:
        ck.pending_persist = None
    held_now = complete_slots(ck.paths, ck.rank)  # only steps ≤ info.step are left
    if held_now:  # the next snapshot must overwrite the invalidated slot, not the one restored
        ck.writer.latest_slot = held_now[0].slot
    _forget_storage_after(ck, info.step)
    return info


def _forget_storage_after(ck: Checkpointer, step: int) -> None:
    """Delete committed checkpoints newer than ``step`` (under the keeper's persist lock, so no
    persist is half-way), move ``latest`` back, and tell each node's keeper."""
    if ck.rank == 0:
        with ck.job.persist_lock():
            newer = ck.storage.forget_after(step)
        if newer:
            log.warning("rollback to step %d: removed newer checkpoint(s) %s from %s", step, newer, ck.storage.url)
    if dist.is_initialized():
        dist.barrier(ck.group)
    if ck.use_keeper:
        ck.keeper.rolled_back(step)
        if dist.is_initialized():
            dist.barrier(ck.group)

"""Pick and load the state to resume from: a memory snapshot at the same world size (own host or a
peer's: ``peer_restore``) → another world size's, resharded (``memory_reshard``) → the newest committed
checkpoint whose checksums verify → a fresh start. Every rank takes the same decision (one all-gather
per question), and every skipped candidate is named in a warning; a training-health rollback
(``roll_back``) too. See docs/checkpoint.md, "Restore".
"""

from __future__ import annotations

import io
import logging
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from stalwart._compat import checkpoint_reader, flatten_state_dict
from stalwart.checkpoint import memory_reshard, peer_restore
from stalwart.checkpoint.peer_restore import Location, gather
from stalwart.checkpoint.shm import JobPaths, SlotInfo, complete_slots
from stalwart.checkpoint.snapshot import SnapshotView
from stalwart.checkpoint.state import RNG_KEY, TrainingState, local_tensor, set_path
from stalwart.checkpoint.storage import Storage, step_name

if TYPE_CHECKING:
    from stalwart.checkpoint.checkpointer import Checkpointer

log = logging.getLogger("stalwart.checkpoint")


@dataclass
class RestoreInfo:
    source: str  # "memory" | "storage" | "fresh"
    step: int
    seconds: float
    detail: str
    skipped: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- safe DCP reading ------------------------------------------------------------------------------
class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but non-tensor items are unpickled with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def storage_reader(storage: Storage, step: int) -> Any:
    """A DCP reader for one checkpoint whose ``.metadata`` goes through the restricted unpickler."""
    return checkpoint_reader(
        storage.checkpoint_id(step),
        local=storage.local,
        read_metadata=lambda: storage.read_metadata(step),
        **({} if storage.local else storage.options),
    )


def load_checkpoint(storage: Storage, step: int, nested: dict[str, Any], group: Any = None) -> None:
    """Fill ``nested`` (a state dict of existing tensors) from a committed checkpoint, in place."""
    single = not dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            nested,
            storage_reader=storage_reader(storage, step),
            planner=SafeLoadPlanner(),
            process_group=None if single else group,
            no_dist=single,
        )


# -- restore --------------------------------------------------------------------------------------
def _layout_problem(view: SnapshotView, flat: dict[str, Any]) -> str | None:
    """Why this run's state cannot be read from ``view`` (None if it can). Tensors must match one to
    one; objects the snapshot has beyond this run's (e.g. the nested-layout hyperparameters, a dropped
    extra) are ignored, as a load from storage ignores them."""
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    if set(tensors) != set(view.entries) or not set(flat) - set(tensors) <= set(view.objects):
        diff = sorted((set(tensors) ^ set(view.entries)) | (set(flat) - set(tensors) - set(view.objects)))[:5]
        return f"snapshot keys differ from this run's state (e.g. {diff})"
    for key, t in tensors.items():
        e, local = view.entries[key], local_tensor(t)
        if list(local.shape) != e["shape"] or str(local.dtype).removeprefix("torch.") != e["dtype"]:
            return f"{key}: snapshot has {e['dtype']}{e['shape']}, this run {local.dtype}{list(local.shape)}"
    return None


def _from_memory(location: Location | None, problem: str | None, tstate: TrainingState, group: Any) -> str | None:
    """Load this rank's slot if every rank can; returns the reason when any rank cannot."""
    nested = tstate.state_dict(for_load=True)
    flat, mappings = flatten_state_dict(nested)
    view = None
    try:
        if location is None or problem:
            problem = problem or "no copy on this host"
        else:
            view = SnapshotView(*location)
            problem = _layout_problem(view, flat)
    except (BlockingIOError, OSError, ValueError, RuntimeError) as err:
        problem = f"cannot open: {err}"
    problems = gather(problem, group)
    if any(problems):
        if view is not None:
            view.close()
        return "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
    assert view is not None
    with view, torch.no_grad():
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                view.read_into(key, local_tensor(value))
            else:
                set_path(nested, mappings[key], view.objects[key])
    tstate.load(nested)
    return None


def _prune_missing(nested: dict[str, Any], present: set[str], rank: int) -> list[str]:
    """Drop leaves the checkpoint lacks (e.g. RNG of a rank that did not exist when it was saved)."""
    flat, mappings = flatten_state_dict(nested)
    missing = [k for k in flat if k not in present]
    rng_prefix = f"{RNG_KEY}.rank{rank}."
    if any(k.startswith(rng_prefix) for k in missing):
        nested.get(RNG_KEY, {}).pop(f"rank{rank}", None)
    for key in missing:
        if not key.startswith(rng_prefix):
            path = mappings[key]
            node: Any = nested
            for part in path[:-1]:
                node = node[part]
            if isinstance(node, dict):
                node.pop(path[-1], None)
    return missing


def _verify(storage: Storage, step: int, rank: int, world: int, group: Any) -> list[str]:
    manifest = storage.manifest(step)
    if manifest is None:
        return [f"{step_name(step)}: manifest vanished"]
    files = sorted(manifest["files"])[rank::world]
    return [p for ps in gather(storage.verify(step, files), group) for p in ps]


def _my_slots(paths: JobPaths | None, rank: int, world: int, max_step: int | None) -> dict[int, SlotInfo]:
    mine: dict[int, SlotInfo] = {}
    for s in complete_slots(paths, rank) if paths else []:
        if s.header.get("world_size") == world and (max_step is None or s.step <= max_step):
            mine.setdefault(s.step, s)
    return mine


def candidates(
    paths: JobPaths | None, storage: Storage | None, rank: int, world: int, group: Any = None
) -> tuple[list[int], list[int]]:
    """(memory steps every rank holds, committed steps), both newest first; the same on every rank."""
    mine = _my_slots(paths, rank, world, None)
    common = set.intersection(*(set(steps) for steps in gather(sorted(mine), group)))
    committed = gather(storage.committed() if storage and rank == 0 else [], group)[0]
    return sorted(common, reverse=True), committed


def restore_state(
    tstate: TrainingState,
    paths: JobPaths | None,
    storage: Storage | None,
    rank: int,
    world: int,
    group: Any = None,
    max_step: int | None = None,
    trajectory: tuple[int, int] = (0, 0),
) -> RestoreInfo:
    """Restore the newest usable state (at most ``max_step`` if given: a rollback). ``trajectory``: the
    (epoch, restores) that snapshots taken after this restore carry (``SnapshotWriter``)."""
    t0 = time.perf_counter()
    skipped: list[str] = []
    copies = peer_restore.host_copies(paths, world, max_step) if paths else {}
    tables = gather(peer_restore.held(copies), group)
    common = peer_restore.agreed_steps(tables, world)
    committed = gather(storage.committed() if storage and rank == 0 else [], group)[0]
    committed = [s for s in committed if max_step is None or s <= max_step]
    mem_step = max(common) if common else None
    if paths and not common and any(tables):
        held = peer_restore.describe(tables, world)
        skipped.append(f"memory: no snapshot step held for every rank at this world size ({held})")

    tried_memory = mem_step is not None and (not committed or mem_step >= committed[0])
    if tried_memory:
        assert paths is not None and mem_step is not None
        location, problem, fetched = peer_restore.obtain(paths, copies, tables, mem_step, rank, world, group)
        problem = _from_memory(location, problem, tstate, group)
        peer_restore.clear_fetched(paths)
        if problem is None:
            _invalidate_after(paths, mem_step, group, trajectory)
            where = f"; {fetched} rank(s) fetched from peers' memory" if fetched else ""
            return RestoreInfo(
                "memory",
                mem_step,
                time.perf_counter() - t0,
                f"shared-memory snapshot of step {mem_step} held for all {world} ranks{where}",
                skipped,
            )
        skipped.append(f"memory step {mem_step}: {problem}")
        log.warning("memory snapshot of step %d not usable: %s", mem_step, problem)

    if paths is not None:
        newest = committed[0] if committed else -1
        resharded = _from_old_world(tstate, paths, rank, world, group, newest, max_step, skipped, trajectory)
        if resharded is not None:
            return RestoreInfo("memory", resharded[0], time.perf_counter() - t0, resharded[1], skipped)

    for step in committed:
        assert storage is not None
        problems = _verify(storage, step, rank, world, group)
        if problems:
            skipped.append(f"storage {step_name(step)}: {'; '.join(problems)}")
            log.warning("checkpoint %s skipped: %s", storage.path(step_name(step)), "; ".join(problems))
            continue
        nested = tstate.state_dict(for_load=True)
        missing = _prune_missing(nested, set(storage.read_metadata(step).state_dict_metadata), rank)
        if missing:
            log.warning(
                "rank %d: checkpoint %s lacks %d keys of this run (kept as initialised): %s",
                rank,
                step_name(step),
                len(missing),
                ", ".join(missing[:5]),
            )
        load_checkpoint(storage, step, nested, group)
        tstate.load(nested)
        _invalidate_after(paths, step, group, trajectory)
        return RestoreInfo(
            "storage", step, time.perf_counter() - t0, f"committed checkpoint {storage.path(step_name(step))}", skipped
        )
    _invalidate_after(paths, -1, group, trajectory)
    if tried_memory:  # its template initialised the optimizers (a zero-lr step): undo for a true fresh start
        for opt in tstate.optimizers:
            opt.state.clear()
    detail = "no checkpoint found" if not skipped else "no usable checkpoint"
    return RestoreInfo("fresh", 0, time.perf_counter() - t0, detail, skipped)


def _from_old_world(
    tstate: TrainingState,
    paths: JobPaths,
    rank: int,
    world: int,
    group: Any,
    newer_than: int,
    max_step: int | None,
    skipped: list[str],
    trajectory: tuple[int, int],
) -> tuple[int, str] | None:
    """Reshard the snapshots of another world size (a shrunk job: ``memory_reshard``) if they hold a
    step newer than ``newer_than``: (step, detail), or None to go on to storage."""
    copies, mine = memory_reshard.held_by_world(paths, world)
    tables = gather(mine, group)
    chosen = memory_reshard.pick(tables, world, newer_than, max_step)
    if chosen is None:
        return None
    old_world, step = chosen
    old = memory_reshard.OldWorld(paths, copies.get(old_world, {}), old_world, step)
    try:
        old.plan(tables, rank, group)
        nested = tstate.state_dict(for_load=True)
        missing = _prune_missing(nested, set(old.metadata.state_dict_metadata), rank)
        try:
            planner = SafeLoadPlanner()
            planner.set_up_planner(nested, old.metadata, is_coordinator=rank == 0)
            needs, problem = old.needs(planner.create_local_plan()), None
        except (KeyError, ValueError, RuntimeError) as err:
            needs, problem = set(), f"this run's state cannot be read from it: {err!r}"
        memory_reshard.agree(problem, group)
        fetched = old.fetch(needs, tables, rank, group)
        reader = memory_reshard.MemoryReader(old.metadata, old.owner, old.views)
        single = not dist.is_initialized()
        dcp.load(nested, storage_reader=reader, planner=SafeLoadPlanner(), process_group=group, no_dist=single)
        tstate.load(nested)
    except (memory_reshard.ReshardError, CheckpointException) as err:
        skipped.append(f"memory step {step} at {old_world} ranks: {err}")
        log.warning("memory snapshots of step %d at %d ranks not usable: %s", step, old_world, err)
        for opt in tstate.optimizers:  # the load's template stepped them (zero lr): storage or fresh start next
            opt.state.clear()
        return None
    finally:
        old.close()
        peer_restore.clear_fetched(paths)
    if missing:
        log.warning("rank %d: the snapshots lack %d keys of this run (kept as initialised)", rank, len(missing))
    _invalidate_after(paths, step, group, trajectory)
    where = f"; {fetched} cop(ies) fetched from peers' memory" if fetched else ""
    return step, f"shared-memory snapshots of step {step} at {old_world} ranks, resharded to {world}{where}"


def _invalidate_after(paths: JobPaths | None, step: int, group: Any, trajectory: tuple[int, int]) -> None:
    """Forget the snapshots on this host beyond the resumed step (every rank directory, also of ranks
    held before a regroup, and the peers' copies): they belong to another trajectory and must never be
    paired with another rank's snapshot of the same step. Ends in a collective, so no rank snapshots
    its next step while a rank on its node is still removing."""
    if paths:
        peer_restore.invalidate_after(paths, step, trajectory)
    gather(None, group)


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

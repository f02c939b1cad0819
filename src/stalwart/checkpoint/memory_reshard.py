"""Memory restore into another world size: a shrunk job's old snapshots (the survivors' and the lost
node's copies) of a step newer than storage's are read as one DCP checkpoint, without storage, and
resharded by DCP's own load planner; ``dcp.load`` reads through :class:`MemoryReader`. A failure on any
rank is raised on all (:class:`ReshardError`), and the caller falls back to storage.
See docs/checkpoint.md, "A shrunk job restores from memory too".
"""

from __future__ import annotations

import io
import socket
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from stalwart.checkpoint import peer_restore
from stalwart.checkpoint.peer_restore import FETCHED, Location, gather, held, host_copies
from stalwart.checkpoint.persist import PlanOnlyView, plan_items, plan_table
from stalwart.checkpoint.replicas import host_roots
from stalwart.checkpoint.shm import JobPaths, complete_slots
from stalwart.checkpoint.snapshot import SnapshotView

Tables = dict[int, dict[int, list[int]]]  # old world size → old rank → steps held on one host


class ReshardError(RuntimeError):
    """The same on every rank: why the old world's snapshots could not be read."""


def old_worlds(paths: JobPaths, world: int) -> dict[int, dict[int, dict[int, Location]]]:
    """old world size → rank → step → where on this host: snapshots taken at another world size."""
    sizes = {
        int(s.header["world_size"])
        for root in host_roots(paths)
        for r in root.ranks()
        for s in complete_slots(root, r)
        if s.header.get("world_size") not in (None, world)
    }
    return {w: host_copies(paths, w) for w in sorted(sizes)}


def pick(tables: list[Tables], world: int, newer_than: int, max_step: int | None) -> tuple[int, int] | None:
    """(old world size, step): the newest step newer than ``newer_than`` that some host holds for every
    rank of another world size (the larger world on a tie); None if there is none."""
    best: tuple[int, int] | None = None
    for w in sorted({w for t in tables for w in t} - {world}):
        steps = peer_restore.agreed_steps([t.get(w, {}) for t in tables], w)
        steps = {s for s in steps if s > newer_than and (max_step is None or s <= max_step)}
        if steps and (best is None or (max(steps), w) > (best[1], best[0])):
            best = (w, max(steps))
    return best


def _key(fqn: str, offset: Any) -> tuple[str, tuple[int, ...]]:
    return fqn, tuple(offset) if offset is not None else ()


class MemoryReader(StorageReader):
    """A DCP reader over snapshots in shared memory: ``owner`` says which old rank holds each stored
    item, ``views`` are the open snapshots of the old ranks this rank reads."""

    def __init__(self, metadata: Any, owner: dict[tuple[str, tuple[int, ...]], int], views: dict[int, SnapshotView]):
        super().__init__()
        self.metadata, self.owner, self.views = metadata, owner, views

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self.metadata

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        for item in plan.items:
            view = self.views[self.owner[_key(item.storage_index.fqn, item.storage_index.offset)]]
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(view.objects[item.storage_index.fqn], buf)  # read back with weights_only
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            src = view.tensor(item.storage_index.fqn)
            for dim, (at, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                src = src.narrow(dim, at, length)
            target = planner.resolve_tensor(item).detach()
            if target.shape != src.shape:  # never broadcast into place: DCP turns this into a fallback
                raise ValueError(
                    f"{item.storage_index.fqn}: snapshot chunk {tuple(src.shape)}, load wants {tuple(target.shape)}"
                )
            target.copy_(src)
            planner.commit_tensor(item, target)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def agree(problem: str | None, group: Any) -> None:
    """Raise :class:`ReshardError` on every rank if any rank has a problem."""
    problems = gather(problem, group)
    if any(problems):
        raise ReshardError("; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p))


class OldWorld:
    """The old world's snapshots of one step, as this rank sees them; see the module docstring."""

    def __init__(self, paths: JobPaths, copies: dict[int, dict[int, Location]], world: int, step: int) -> None:
        self.paths, self.copies, self.world, self.step = paths, copies, world, step
        self.metadata: Any = None
        self.owner: dict[tuple[str, tuple[int, ...]], int] = {}
        self.views: dict[int, SnapshotView] = {}

    def _held(self, table: Tables) -> set[int]:
        return {r for r, steps in table.get(self.world, {}).items() if self.step in steps}

    def plan(self, tables: list[Tables], rank: int, group: Any) -> None:
        """DCP's metadata and the owner of every stored item, from every old rank's entry table (each
        read on the lowest rank whose host holds that rank's copy)."""
        holder = {r: min(q for q, t in enumerate(tables) if r in self._held(t)) for r in range(self.world)}
        mine: dict[int, Any] = {}
        problem = None
        try:
            for r in (r for r, q in holder.items() if q == rank):
                with SnapshotView(*self.copies[r][self.step]) as view:
                    mine[r] = plan_table(view)
        except (OSError, ValueError, RuntimeError) as err:
            problem = f"cannot open the snapshot: {err}"
        parts = gather((mine, problem), group)
        if any(p for _, p in parts):
            raise ReshardError("; ".join(f"rank {q}: {p}" for q, (_, p) in enumerate(parts) if p))
        every = {r: t for part, _ in parts for r, t in part.items()}
        try:  # the same tables on every rank: DCP's plan checks fail on all of them alike
            _, plans, self.metadata = plan_items([PlanOnlyView(every[r]) for r in range(self.world)])
        except (ValueError, RuntimeError, KeyError) as err:
            raise ReshardError(f"the old world's snapshots do not plan as one checkpoint: {err!r}") from err
        self.owner = {_key(i.index.fqn, i.index.offset): r for r, plan in enumerate(plans) for i in plan.items}

    def needs(self, local: LoadPlan) -> set[int]:
        """The old ranks whose snapshots a load plan reads."""
        return {self.owner[_key(i.storage_index.fqn, i.storage_index.offset)] for i in local.items}

    def fetch(self, needs: set[int], tables: list[Tables], rank: int, group: Any) -> int:
        """Bring the needed old ranks' copies this host lacks (once per host and old rank), verify the
        local replicas, and open every needed snapshot. Returns how many copies moved between hosts."""
        host = (socket.gethostname(), str(self.paths.root.resolve()))
        rows = gather((host, sorted(needs)), group)
        held_on = [self._held(t) for t in tables]
        moves: list[tuple[int, int, int]] = []  # (source rank, destination rank, old rank)
        for r in range(self.world):
            hosts = {h for q, (h, _) in enumerate(rows) if r in held_on[q]}
            for q, (h, wanted) in enumerate(rows):
                if r in wanted and h not in hosts:
                    hosts.add(h)  # one fetch per host: its other ranks read the same copy
                    moves.append((min(p for p in range(len(rows)) if r in held_on[p]), q, r))
        received = peer_restore.move(self.paths, self.copies, self.step, moves, rank, group) if moves else {}
        problem = next((p for _, p in received.values() if p), None)
        agree(problem, group)  # every fetch has landed before any rank looks for it
        fetched = JobPaths(self.paths.root / FETCHED)
        try:
            for r in sorted(needs):
                location = self.copies.get(r, {}).get(self.step)
                if location is None:
                    location = (fetched, next(s for s in complete_slots(fetched, r) if s.step == self.step))
                else:
                    problem = problem or peer_restore.verify_copy(location)
                self.views[r] = SnapshotView(*location)
        except (OSError, ValueError, RuntimeError, StopIteration) as err:
            problem = f"cannot open the snapshot: {err!r}"
        agree(problem, group)
        return len(moves)

    def close(self) -> None:
        for view in self.views.values():
            view.close()
        self.views.clear()


def held_by_world(paths: JobPaths, world: int) -> tuple[dict[int, dict[int, dict[int, Location]]], Tables]:
    """This host's old-world copies, and their table for the all-gather."""
    copies = old_worlds(paths, world)
    return copies, {w: held(c) for w, c in copies.items()}

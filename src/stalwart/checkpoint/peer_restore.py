"""Memory restore when the snapshots are spread over hosts (after a node loss or a regroup, rank r's
snapshot may lie in another node's rank directory or in a peer replica): the ranks agree on the newest
step some host holds for every rank, and a rank whose host lacks its copy receives it over the process
group. See docs/checkpoint.md, "Peer replicas" ("Restore from peers"). Transfers run in one order on
every rank, so the blocking sends and receives cannot wait on each other in a cycle.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stalwart.checkpoint.replicas import REPLICAS_DIR, RESTORED, host_roots, replica_roots
from stalwart.checkpoint.shm import FETCHED, JobPaths, SlotInfo, atomic_write, complete_slots, data_crc32, secure_dir

Location = tuple[JobPaths, SlotInfo]


def gather(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (our own ranks' small tables); also without torch.distributed."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def host_copies(paths: JobPaths, world: int, max_step: int | None = None) -> dict[int, dict[int, Location]]:
    """rank → step → where on this host a complete snapshot taken at ``world`` ranks lies: this node's
    own rank directories first, then other nodes' replicas (newest copy first)."""
    out: dict[int, dict[int, Location]] = {}
    for root in host_roots(paths):
        for r in root.ranks():
            if r >= world:
                continue
            for s in complete_slots(root, r):
                if s.header.get("world_size") == world and (max_step is None or s.step <= max_step):
                    out.setdefault(r, {}).setdefault(s.step, (root, s))
    return out


def held(copies: dict[int, dict[int, Location]]) -> dict[int, list[int]]:
    return {r: sorted(steps) for r, steps in copies.items()}


def agreed_steps(tables: list[dict[int, list[int]]], world: int) -> set[int]:
    """Steps that some host holds for every rank (``tables``: one per rank, of its host's copies)."""
    per_rank = [set().union(*(t.get(r, ()) for t in tables)) for r in range(world)]
    return set.intersection(*per_rank) if per_rank else set()


def describe(tables: list[dict[int, list[int]]], world: int) -> str:
    """Which steps some host holds per rank, for the message that says why memory was not used."""
    held_by = [sorted(set().union(*(t.get(r, ()) for t in tables))) for r in range(world)]
    return ", ".join(f"rank {r}: {steps or 'none'}" for r, steps in enumerate(held_by))


def transfers(tables: list[dict[int, list[int]]], step: int, world: int) -> list[tuple[int, int]]:
    """(source rank, destination rank) for every rank whose host lacks its copy of ``step``."""
    out = []
    for r in range(world):
        if step not in tables[r].get(r, ()):
            out.append((min(q for q in range(world) if step in tables[q].get(r, ())), r))
    return out


def verify_copy(location: Location) -> str | None:
    """A replica's bytes against the CRC32 its receiver recorded (own snapshots carry none)."""
    paths, slot = location
    expected = slot.header.get("replica", {}).get("crc32_bin")
    if expected is None:
        return None
    try:
        with open(paths.slot(slot.rank, slot.slot, "bin"), "rb") as f:
            crc = data_crc32(f, int(slot.header["data_bytes"]))  # None: truncated
    except OSError as err:  # pruned or overwritten since it was listed
        return f"replica of rank {slot.rank} unreadable: {err}"
    return None if crc == expected else f"replica of rank {slot.rank} fails its CRC32 check"


def obtain(
    paths: JobPaths,
    copies: dict[int, dict[int, Location]],
    tables: list[dict[int, list[int]]],
    step: int,
    rank: int,
    world: int,
    group: Any,
) -> tuple[Location | None, str | None, int]:
    """This rank's snapshot of ``step``: (where it now lies on this host, why not, ranks fetched).
    Every failure becomes the returned reason, so all ranks fall back to storage together."""
    moves = transfers(tables, step, world)
    location = copies.get(rank, {}).get(step)
    problem = verify_copy(location) if location else None
    if not moves:
        return location, problem, 0
    received = move(paths, copies, step, [(src, dst, dst) for src, dst in moves], rank, group)
    location, problem = received.get(rank, (location, problem))
    return location, problem, len(moves)


def move(
    paths: JobPaths,
    copies: dict[int, dict[int, Location]],
    step: int,
    moves: list[tuple[int, int, int]],
    rank: int,
    group: Any,
) -> dict[int, tuple[Location | None, str | None]]:
    """Carry out ``(source rank, destination rank, snapshot's rank)`` transfers of ``step``, in one order
    on every rank; what this rank received: snapshot's rank → (where it lies in ``fetched/``, why not)."""
    received: dict[int, tuple[Location | None, str | None]] = {}
    g = _cpu_group(group)
    try:
        for src, dst, r in moves:
            if rank == src:
                _send(copies[r][step], _global(group, dst), g)
            elif rank == dst:
                received[r] = _receive(paths, r, _global(group, src), g)
    finally:
        if g is not group:
            dist.destroy_process_group(g)
    return received


def clear_fetched(paths: JobPaths) -> None:
    shutil.rmtree(paths.root / FETCHED, ignore_errors=True)


def invalidate_after(paths: JobPaths, step: int, trajectory: tuple[int, int] = (0, 0)) -> None:
    """Forget every snapshot on this host beyond the resumed step — this node's rank directories (also
    of ranks it held before a regroup) and the peers' copies: another trajectory's, never to be agreed
    on. Collective use only (see ``restore._invalidate_after``): it removes other ranks' snapshots."""
    _forget_after([paths], step)
    invalidate_replicas_after(paths, step, trajectory)


def invalidate_replicas_after(paths: JobPaths, step: int, trajectory: tuple[int, int] = (0, 0)) -> None:
    """Forget the peers' copies on this host beyond ``step`` and record the restore with the
    ``trajectory`` (epoch, restores) its later snapshots carry, so that a copy of a later step still in
    flight, taken before the restore, is refused (``replicas.restore_floor``)."""
    _forget_after([JobPaths(p) for p in replica_roots(paths.root)], step)
    if (paths.root / REPLICAS_DIR).is_dir():
        atomic_write(
            paths.root / REPLICAS_DIR / RESTORED, json.dumps({"step": step, "trajectory": list(trajectory)}).encode()
        )


def _forget_after(roots: list[JobPaths], step: int) -> None:
    for root in roots:
        for r in root.ranks():
            for s in complete_slots(root, r):
                if s.step > step:
                    root.slot(r, s.slot, "json").unlink(missing_ok=True)


# -- the transfer ------------------------------------------------------------------------------------
def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _cpu_group(group: Any) -> Any:
    """A group that moves CPU tensors: the given one if it runs gloo, else a gloo twin (collective;
    destroyed after the transfers)."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


def _send(location: Location, dst: int, group: Any) -> None:
    """One copy to ``dst``: sizes first (zeros: unreadable), then header, bytes and objects at once."""
    paths, slot = location
    meta, payload = [0, 0, 0, 0, 0], bytearray()
    try:
        header = paths.slot(slot.rank, slot.slot, "json").read_bytes()
        blob = paths.slot(slot.rank, slot.slot, "obj").read_bytes()
        n = int(slot.header["data_bytes"])
        payload = bytearray(len(header) + n + len(blob))
        payload[: len(header)] = header
        with open(paths.slot(slot.rank, slot.slot, "bin"), "rb") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)  # a replica push takes the other slot meanwhile
            got = f.readinto(memoryview(payload)[len(header) : len(header) + n])
        payload[len(header) + n :] = blob
        data = memoryview(payload)[len(header) : len(header) + n]
        if got != n or json.loads(header).get("generation") != slot.generation:
            raise OSError("overwritten since it was listed")
        expected = slot.header.get("replica", {}).get("crc32_bin")
        if expected is not None and zlib.crc32(data) != expected:
            raise OSError("replica fails its CRC32 check")
        meta = [1, len(header), n, len(blob), zlib.crc32(data)]
    except (OSError, ValueError):
        meta = [0, 0, 0, 0, 0]
    dist.send(torch.tensor(meta, dtype=torch.int64), dst=dst, group=group)
    if meta[0]:
        dist.send(torch.frombuffer(payload, dtype=torch.uint8), dst=dst, group=group)


def _receive(paths: JobPaths, rank: int, src: int, group: Any) -> tuple[Location | None, str | None]:
    meta = torch.zeros(5, dtype=torch.int64)
    dist.recv(meta, src=src, group=group)
    ok, n_header, n_data, n_obj, crc = (int(v) for v in meta)
    if not ok:
        return None, f"the copy on global rank {src}'s host could not be read"
    buf = torch.empty(n_header + n_data + n_obj, dtype=torch.uint8)
    dist.recv(buf, src=src, group=group)
    raw = memoryview(buf.numpy())
    header, data, blob = raw[:n_header], raw[n_header : n_header + n_data], raw[n_header + n_data :]
    if zlib.crc32(data) != crc:
        return None, f"the copy from global rank {src} fails its CRC32 check"
    fetched = JobPaths(paths.root / FETCHED)
    try:
        for d in (fetched.root, fetched.rank_dir(rank)):
            secure_dir(Path(d))
        atomic_write(fetched.slot(rank, 0, "bin"), data)
        atomic_write(fetched.slot(rank, 0, "obj"), blob)
        atomic_write(fetched.slot(rank, 0, "json"), header)
        return (fetched, SlotInfo(rank, 0, json.loads(bytes(header)))), None
    except (OSError, ValueError, RuntimeError) as err:  # e.g. a full tmpfs: fall back to storage
        return None, f"cannot keep the copy fetched from global rank {src}: {err}"

"""The file layout of one job's shared-memory directory, and the small helpers every process that
reads or writes it uses (workers, the keeper, the agent's save-on-failure, ``stalwart ckpt``).

Stdlib only (psutil lazily): it is imported by the snapshot writer in every worker and by the agent.

    <shm_root>/stalwart/<job key>/
        job.json  job.lock  keeper.lock  keeper.json  persist.lock  keeper.log
        rank<r>/  owner.json  closed.json  slot<i>.bin  slot<i>.obj  slot<i>.json
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = 1  # slot header format
SLOTS = (0, 1)  # double-buffered: a snapshot is written into the slot not holding the newest one


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by rename, so a reader sees the old or the new content, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a SIGKILLed worker stays a zombie until reaped)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class JobPaths:
    """Where one job's snapshots and keeper files live in shared memory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def rank_dir(self, rank: int) -> Path:
        return self.root / f"rank{rank}"

    def slot(self, rank: int, slot: int, suffix: str) -> Path:
        return self.rank_dir(rank) / f"slot{slot}.{suffix}"

    def owner(self, rank: int) -> Path:
        return self.rank_dir(rank) / "owner.json"

    def closed(self, rank: int) -> Path:
        return self.rank_dir(rank) / "closed.json"

    @property
    def job(self) -> Path:
        return self.root / "job.json"

    @property
    def job_lock(self) -> Path:
        """Workers hold it shared while attached; the keeper removes files only if it gets it exclusively."""
        return self.root / "job.lock"

    @property
    def keeper_lock(self) -> Path:
        return self.root / "keeper.lock"

    @property
    def keeper_status(self) -> Path:
        return self.root / "keeper.json"

    @property
    def persist_lock(self) -> Path:
        return self.root / "persist.lock"

    def ranks(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name[4:]) for p in self.root.glob("rank*") if p.name[4:].isdigit())


@dataclass(frozen=True)
class SlotInfo:
    rank: int
    slot: int
    header: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def generation(self) -> int:
        return int(self.header["generation"])


_headers: dict[Path, tuple[tuple[int, int, int], dict[str, Any] | None]] = {}


def read_header(path: Path) -> dict[str, Any] | None:
    """A slot header, parsed again only when the file changed (the keeper polls them constantly).
    Headers are replaced by rename, so (inode, mtime, size) identifies a version."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        _headers.pop(path, None)
        return None
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    cached = _headers.get(path)
    if cached is None or cached[0] != key:
        cached = (key, read_json(path))
        _headers[path] = cached
    return cached[1]


def complete_slots(paths: JobPaths, rank: int) -> list[SlotInfo]:
    """This rank's complete snapshots, newest first."""
    found = []
    for slot in SLOTS:
        header = read_header(paths.slot(rank, slot, "json"))
        if header and header.get("format") == FORMAT and header.get("rank") == rank:
            found.append(SlotInfo(rank, slot, header))
    return sorted(found, key=lambda s: s.generation, reverse=True)

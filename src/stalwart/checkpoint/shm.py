"""The file layout of a job's shared-memory directory (docs/checkpoint.md "Tier 1"), and the helpers every
process that uses it needs. Stdlib only (psutil lazily): every worker's snapshot writer and the agent import it.

    <shm_root>/stalwart-<uid>/<job key>/          (0700, owned by the user: snapshots hold the weights)
        job.json  job.lock  keeper.lock  keeper.json  persist.lock  keeper.log  rollback.json  kept.json
        rank<r>/  owner.json  closed.json  slot<i>.bin  slot<i>.obj  slot<i>.json
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import re
import socket
import stat
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from stalwart import runtime
from stalwart.runtime import ENV_SNAPSHOT_SLOTS, worker_env

FORMAT = 1  # slot header format
SLOTS = (0, 1)  # double-buffered: a snapshot is written into the slot not holding the newest one
MAX_SLOTS = 3  # a third slot under peer replicas: copies that trail by two steps still meet a survivor's
ENV_SLOTS = ENV_SNAPSHOT_SLOTS  # set by `stalwart run --replicas K` for its workers
# Entries of a job directory that torch-using modules own, named here so that an idle keeper, which
# imports no torch, tells a directory holding no job from one holding snapshots (keeper_process)
REPLICAS_DIR = "replicas"  # peers' copies (replicas.py)
REPLICA_STATUS = "replicas.json"  # the replicator's status (replicator.py)
FETCHED = "fetched"  # copies fetched for a restore (peer_restore.py)


class ShmPermissionError(RuntimeError):
    """A shared-memory directory that is not safely ours (another user's, a symlink, open to others)."""


def user_dir(shm_root: str | Path) -> Path:
    """This user's directory under the shm root: per user, so nobody reads another's weights and the
    first user on a host does not lock everyone else out."""
    return Path(shm_root) / f"stalwart-{os.geteuid()}"


def default_shm_root() -> str:
    """Where snapshots live unless a job names its own root: ``$STALWART_SHM_DIR`` (a tmpfs elsewhere, or a
    private root per test session; `stalwart run`'s keeper and its workers read the same) or /dev/shm."""
    return os.environ.get(runtime.ENV_SHM_DIR) or "/dev/shm"


def job_dir_for(
    storage_url: str, shm_root: str | Path | None = None, job_id: str | None = None, node_id: str | None = None
) -> Path:
    """A job's shared-memory directory on this node, under the user's ``stalwart-<uid>``: one per storage
    location (or job id), and per node id under ``stalwart run``, so agents sharing a host keep apart."""
    env = worker_env()
    key = job_id or env.job_id or hashlib.sha1(storage_url.encode()).hexdigest()[:16]
    node = node_id or env.node_id
    if node:
        key += "-" + re.sub(r"[^A-Za-z0-9._-]", "_", node)
    return user_dir(shm_root or default_shm_root()) / key


def _check_shm_root(shm_root: Path) -> None:
    """The tmpfs itself may be a symlink (``/dev/shm`` → ``/run/shm``), but must belong to root or to
    us, or be sticky: otherwise its owner (or anyone, if it is world-writable) could swap our directory."""
    try:
        st = os.stat(shm_root)
    except FileNotFoundError:
        raise ShmPermissionError(f"shm root {shm_root} does not exist; use a tmpfs such as /dev/shm") from None
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise ShmPermissionError(f"shm root {shm_root} is not a directory; use a tmpfs such as /dev/shm")
    if st.st_uid not in (0, me) and not st.st_mode & stat.S_ISVTX:
        raise ShmPermissionError(
            f"shm root {shm_root} belongs to uid {st.st_uid} (you are uid {me}) and is not sticky: its owner "
            "could replace your snapshots; set checkpoint.shm_dir to a tmpfs directory you own"
        )
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise ShmPermissionError(
            f"shm root {shm_root} is world-writable without the sticky bit (mode {stat.S_IMODE(st.st_mode):o}): "
            "anyone could rename your snapshot directory; chmod +t it or choose another checkpoint.shm_dir"
        )


def secure_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) or check the existing one: a real directory (never a symlink),
    owned by us; a mode open to others is narrowed to 0700. Raises :class:`ShmPermissionError`."""
    me = os.geteuid()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except PermissionError as err:
        raise ShmPermissionError(
            f"cannot create {path}: {err.strerror}; set checkpoint.shm_dir to a tmpfs you can write"
        ) from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as err:  # ELOOP: a symlink; ENOTDIR: a file planted in its place
        kind = "a symlink" if os.path.islink(path) else "not a directory"
        raise ShmPermissionError(
            f"{path} is {kind}; refusing to follow it (snapshots hold the model's weights): remove it ({err.strerror})"
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != me:
            raise ShmPermissionError(
                f"{path} belongs to uid {st.st_uid}, not to you (uid {me}); it may hold another user's "
                "snapshots: ask them (or root) to remove it, or set checkpoint.shm_dir elsewhere"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def secure_job_dir(root: str | Path) -> Path:
    """Create or check a job directory and the user directory holding it (both 0700 and ours).
    A directory not under a ``stalwart-<uid>`` parent (a test's or a tool's own) is checked alone."""
    root = Path(root)
    parent = root.parent
    if parent.name == f"stalwart-{os.geteuid()}":
        _check_shm_root(parent.parent)
        secure_dir(parent)
    else:
        parent.mkdir(parents=True, exist_ok=True)
    secure_dir(root)
    return root


def data_crc32(f: BinaryIO, size: int) -> int | None:
    """CRC32 of an open slot file's first ``size`` bytes via a read-only mapping; None if shorter (resized)."""
    if os.fstat(f.fileno()).st_size < size:
        return None
    if not size:
        return 0
    with mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
        return zlib.crc32(mapped)


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` by rename, so a reader sees the old or the new content, never half. The file
    is private (0600, whatever the umask) and a symlink planted at the temporary name is not followed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.unlink(missing_ok=True)  # left by a dead process whose pid came back
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_owner(paths: JobPaths, rank: int, world: int, epoch: int = 0) -> None:
    """Say which process holds ``rank``'s snapshots (the keeper tells a live worker from a dead one), and
    of which execution: a keeper that finds it dead reports that execution's failure, not the next one's."""
    owner = {"pid": os.getpid(), "rank": rank, "world_size": world, "epoch": epoch}
    owner.update(host=socket.gethostname(), time=time.time())
    atomic_write(paths.owner(rank), json.dumps(owner).encode())


def pid_alive(pid: Any, started_before: Any = None) -> bool:
    """True if ``pid`` runs and is not a zombie (a SIGKILLed worker stays a zombie until reaped); with
    ``started_before`` (its record's time) also started by then: not a reused pid."""
    import psutil

    try:
        proc = psutil.Process(int(pid))
        return proc.status() != psutil.STATUS_ZOMBIE and (
            started_before is None or proc.create_time() <= float(started_before) + 1.0
        )
    except (psutil.Error, TypeError, ValueError):
        return False


def lock_held(path: Path) -> bool:
    """True when a process holds ``path``'s flock (a missing file: nobody does)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


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

    @property
    def rollback_note(self) -> Path:
        """A rollback moved storage back: the workers tell the keeper, which persists redone steps again."""
        return self.root / "rollback.json"

    @property
    def kept(self) -> Path:
        """The job ended and its snapshots are kept until a time (``shm_gc``): a requeue may restore them."""
        return self.root / "kept.json"  # shm_gc.KEPT

    def ranks(self) -> list[int]:
        """Ranks with a directory here; none once the job directory is gone — also while another
        process removes it (the last rank out of a memory-only job does, perhaps while we look)."""
        try:
            names = os.listdir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(n[4:]) for n in names if n.startswith("rank") and n[4:].isdigit())


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


_json_cache: dict[Path, tuple[tuple[int, int, int], dict[str, Any] | None]] = {}
JSON_CACHE_MAX = 4096  # files remembered (a keeper serving job after job must not grow without bound)


def read_json_cached(path: Path) -> dict[str, Any] | None:
    """A JSON file replaced only by rename, parsed again only when its (inode, mtime, size) changed: the
    keeper polls them constantly. Callers must not change what they get."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        _json_cache.pop(path, None)
        return None
    key = (st.st_ino, st.st_mtime_ns, st.st_size)
    cached = _json_cache.get(path)
    if cached is None or cached[0] != key:
        cached = (key, read_json(path))
        if len(_json_cache) >= JSON_CACHE_MAX:
            _json_cache.clear()
        _json_cache[path] = cached
    return cached[1]


def complete_slots(paths: JobPaths, rank: int) -> list[SlotInfo]:
    """This rank's complete snapshots, newest first."""
    found = []
    for slot in range(MAX_SLOTS):
        header = read_json_cached(paths.slot(rank, slot, "json"))
        if header and header.get("format") == FORMAT and header.get("rank") == rank:
            found.append(SlotInfo(rank, slot, header))
    return sorted(found, key=lambda s: s.generation, reverse=True)


def pin_slot(paths: JobPaths, info: SlotInfo) -> tuple[int, dict[str, Any]]:
    """Hold ``info``'s slot under a shared lock (the writer takes another meanwhile): its fd (closing unpins)
    and header. BlockingIOError when the slot is being written or changed since ``info`` was read."""
    fd = os.open(paths.slot(info.rank, info.slot, "bin"), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        header = read_json(paths.slot(info.rank, info.slot, "json"))
        if not header or header.get("generation") != info.generation:
            raise BlockingIOError(f"rank {info.rank} slot {info.slot} changed before it was pinned")
    except BaseException:
        os.close(fd)
        raise
    return fd, header

"""Snapshots an ended job keeps in shared memory (for a requeue or ``stalwart ckpt persist-from-memory``) and
their expiry (docs/checkpoint.md "Snapshots an ended job leaves"): ``kept.json`` says until when; as nothing
runs then, the next ``stalwart run`` (or a keeper a worker starts) and ``stalwart ckpt gc`` remove what
expired. A *live* directory is never removed: its job or keeper lock is held, or a recorded keeper or rank
process still runs (started before the record: not a reused pid). Removal takes the job lock exclusively
first, as ``NodeJob`` does, so a worker attaching meanwhile wins. Stdlib only (psutil lazily), like ``shm``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stalwart.checkpoint.shm import JobPaths, atomic_write, lock_held, pid_alive, read_json, user_dir

# 6 h: a Slurm requeue waits in the queue minutes to hours, and an operator who finds a failed store
# the same shift can still persist from memory; longer would keep a day's ended jobs in a node's RAM
# (the tests alone left 109 MiB over a day).
DEFAULT_KEEP_S = 6 * 3600.0
KEPT = "kept.json"


def mark_kept(paths: JobPaths, keep_s: float, why: str, step: int | None = None, now: float | None = None) -> str:
    """Record that ``paths.root`` is kept until ``now + keep_s``; returns the line for the console."""
    now = time.time() if now is None else now
    record = {"why": why, "step": step, "kept": now, "until": now + keep_s}
    atomic_write(paths.kept, json.dumps(record).encode())
    return kept_line(paths.root, record)


def kept_line(root: Path, record: dict[str, Any] | None = None) -> str | None:
    """What the console says of a kept directory (None if ``root`` is not kept)."""
    record = record or read_json(JobPaths(root).kept)
    if not record or record.get("until") is None:
        return None
    until = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(float(record["until"])))
    return f"snapshots kept in {root} for the requeue until {until}; `stalwart ckpt gc` removes them"


@dataclass
class StaleDir:
    """One job directory under a user's shm directory, as ``stalwart ckpt gc`` lists it."""

    path: str
    bytes: int
    age_s: float  # since its newest file changed
    until: float | None  # kept.json's expiry (None: unmarked, left by an older stalwart or a killed agent)
    live: str | None  # who owns it (never removed), else None
    expired: bool
    why: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def owner(paths: JobPaths, job_lock: bool = True) -> str | None:
    """Who keeps ``paths.root`` alive, or None (``job_lock=False``: the caller holds the job lock itself)."""
    if job_lock and lock_held(paths.job_lock):
        return "workers attached"
    if lock_held(paths.keeper_lock):
        return "a keeper serves it"
    keeper = read_json(paths.keeper_status) or {}
    if keeper.get("pid") and pid_alive(keeper["pid"], keeper.get("started")):
        return f"keeper pid {keeper['pid']} runs"
    for rank in paths.ranks():
        rec = read_json(paths.owner(rank)) or {}
        closed = read_json(paths.closed(rank)) or {}
        if rec.get("pid") and closed.get("pid") != rec["pid"] and pid_alive(rec["pid"], rec.get("time")):
            return f"rank {rank} (pid {rec['pid']}) runs"
    return None


def _usage(root: Path) -> tuple[int, float]:
    """(bytes held, newest mtime) of the files under ``root``."""
    size, newest = 0, 0.0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            size += st.st_blocks * 512
            newest = max(newest, st.st_mtime)
    try:
        newest = newest or os.lstat(root).st_mtime
    except FileNotFoundError:
        pass
    return size, newest


def scan(shm_root: str | Path, keep_s: float = DEFAULT_KEEP_S, now: float | None = None) -> list[StaleDir]:
    """Every job directory of this user under ``shm_root``, oldest first. An unmarked one expires
    ``keep_s`` (its job's ``keep_shm_s`` if it says) after its newest file changed."""
    now = time.time() if now is None else now
    base = user_dir(shm_root)
    try:
        names = sorted(os.listdir(base))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        root = base / name
        if root.is_symlink() or not root.is_dir():
            continue
        paths = JobPaths(root)
        size, newest = _usage(root)
        kept = read_json(paths.kept) or {}
        until = kept.get("until")
        if until is None:
            policy = (read_json(paths.job) or {}).get("policy") or {}
            # Unmarked: maybe a job between restarts that nobody holds (plain torchrun, memory-only), so
            # never sooner than ``keep_s``, whatever short keep_shm_s the job chose for its kept snapshots.
            deadline = newest + max(float(policy.get("keep_shm_s", keep_s)), keep_s)
        else:
            deadline = float(until)
        live = owner(paths)
        expired = live is None and now >= deadline
        out.append(StaleDir(str(root), size, max(0.0, now - newest), until, live, expired, kept.get("why")))
    return sorted(out, key=lambda d: -d.age_s)


def remove(path: str | Path) -> bool:
    """Remove a job directory unless it is live; under its job lock held exclusively, so a worker
    attaching meanwhile either finds it gone (and creates it anew) or keeps it. True when removed."""
    paths = JobPaths(path)
    try:
        fd = os.open(paths.job_lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except FileNotFoundError:
        return False  # gone already
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if owner(paths, job_lock=False) is not None:
            return False
        shutil.rmtree(paths.root, ignore_errors=True)
        return not paths.root.exists()
    finally:
        os.close(fd)


def sweep(entries: list[StaleDir], everything: bool = False, dry_run: bool = False) -> list[StaleDir]:
    """Remove the expired (``everything``: all) directories nobody owns; those removed (``dry_run``: would be)."""
    due = [d for d in entries if d.live is None and (everything or d.expired)]
    return due if dry_run else [d for d in due if remove(d.path)]


def summary(entries: list[StaleDir], removed: list[StaleDir]) -> str | None:
    """One line for ``stalwart run``'s start: what stale snapshots the node holds, or None if none."""
    gone = {d.path for d in removed}
    # An empty directory is no ended job's (another agent on the node may be starting its keeper in it).
    left = [d for d in entries if d.live is None and d.path not in gone and d.bytes > 0]
    if not entries or not (left or removed):
        return None
    parts = []
    if removed:
        parts.append(f"removed {len(removed)} expired ({sum(d.bytes for d in removed) / 2**20:.1f} MiB)")
    if left:
        parts.append(
            f"{len(left)} kept from ended jobs hold {sum(d.bytes for d in left) / 2**20:.1f} MiB "
            "(`stalwart ckpt gc --all` removes them)"
        )
    return f"stale snapshots in {Path(entries[0].path).parent}: " + "; ".join(parts)


def collect(shm_root: str | Path, keep_s: float = DEFAULT_KEEP_S, now: float | None = None) -> str | None:
    """At a job's start: remove the node's expired directories and say what stale ones there are."""
    entries = scan(shm_root, keep_s, now)
    return summary(entries, sweep(entries))

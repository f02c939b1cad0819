"""Gathering evidence about workers for detection: stack dumps, log tails, files workers write.

Everything here reads processes or files; turning it into incidents is ``detect``'s (pure) job.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("stalwart.agent")
LOG_TAIL_BYTES = 256 << 10


def _state(pid: int) -> str:
    """The process's state letter from /proc ("" when it is gone or unreadable)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _stopped(pid: int) -> bool:
    return _state(pid) in ("T", "t")


def process_running(pid: int) -> bool:
    """The process exists and has not exited (a zombie waiting to be reaped has)."""
    return _state(pid) not in ("", "Z", "X")


def stack_dump(pid: int, timeout_s: float = 10.0) -> str:
    """Python stacks of a process via py-spy (spinning or stopped: py-spy finds no threads in a
    SIGSTOPped process forked from a threaded one — a warm-started worker — so it is continued
    first; it is killed right after the dump anyway)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return "(py-spy is not installed: no stack dump)"
    if _stopped(pid):
        os.kill(pid, signal.SIGCONT)
    try:
        out = subprocess.run(
            [exe, "dump", "--pid", str(pid)], check=False, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return f"(py-spy dump of pid {pid} timed out)"
    return out.stdout or out.stderr


def dump_stacks_and_kill(
    ranks: dict[int, int], started: dict[int, int], real_pid: Callable[[int], int]
) -> dict[int, str]:
    """Print and return the Python stacks of hung workers (``ranks``: local → global rank; ``started``:
    local rank → the pid TorchElastic started, ``real_pid`` the worker behind it under warm start), then
    SIGKILL both: hung processes may ignore SIGTERM (or be stopped)."""
    pids = {local: real_pid(pid) for local, pid in started.items()}
    dumps = {}
    for local, rank in ranks.items():
        if pid := pids.get(local):
            dumps[rank] = stack_dump(pid)
            print(
                f"--- stalwart: Python stacks of rank {rank} (pid {pid}) ---\n{dumps[rank]}",
                file=sys.stderr,
                flush=True,
            )
    for pid in {*started.values(), *pids.values()}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return dumps


def log_tail(path: str | None, limit: int = LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a worker's log ("" when there is none)."""
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - limit))
        return f.read().decode("utf-8", errors="replace")


def fault_time(progress_dir: Path, rank: int) -> float | None:
    """When chaos injected a fault into ``rank``, if it did (it writes the time first)."""
    try:
        return float((progress_dir / f"rank{rank}.fault").read_text())
    except (OSError, ValueError):
        return None


class IncidentTail:
    """Reads the JSON lines workers append to ``rank*.incidents.jsonl``, each line once: remembers
    the offset per file and leaves a partial last line (a write in progress) for the next read."""

    def __init__(self, pattern: str = "rank*.incidents.jsonl") -> None:
        self._offsets: dict[Path, int] = {}
        self.pattern = pattern

    def read(self, directory: Path) -> list[dict[str, Any]]:
        records = []
        for path in sorted(directory.glob(self.pattern)):
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    if os.fstat(f.fileno()).st_size < offset:  # a new file of the same name
                        offset = 0
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            complete = data[: data.rfind(b"\n") + 1]
            self._offsets[path] = offset + len(complete)
            for line in complete.splitlines():
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    log.warning("skipping a malformed line in %s: %r", path, line[:200])
                    continue
                if isinstance(record, dict) and isinstance(record.get("kind"), str):
                    records.append(record)
        return records

    def reset(self) -> None:
        self._offsets.clear()

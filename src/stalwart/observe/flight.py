"""Flight Recorder dumps on request, for hang diagnosis (``stalwart.observe.hangdiag``).

A rank blocked in a collective cannot run a signal handler (its main thread waits in C++), so each
worker runs a ``FlightDumper`` daemon thread: it checks ``rank{R}.fr.request`` in the progress
directory twice a second (one ``stat``, off the step path) and, when the agent touches it, writes
the rank's Flight Recorder ring plus what the ring lacks on gloo — which ranks each process group
holds and what it is (``dp``, ``pp``, ...) — and the rank's mesh coordinates to ``rank{R}.fr.json``.
A rank that never answers (SIGSTOPped, dead, or holding the GIL in C code) says so by its silence.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from stalwart import _compat

POLL_S = 0.5


def request_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.fr.request"


def dump_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.fr.json"


def ready_path(directory: str | Path, rank: int) -> Path:
    """Exists while the rank runs a dumper: the agent asks (and waits for) only those ranks."""
    return Path(directory) / f"rank{rank}.fr.ready"


def with_dumper(directory: str | Path, ranks: list[int]) -> list[int]:
    return [r for r in ranks if ready_path(directory, r).exists()]


def group_table(groups: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"dp": ProcessGroup, ...}`` → ``{group_name: {"label": "dp", "ranks": [...]}}`` (the names
    in Flight Recorder entries are the groups' ``group_name``)."""
    import torch.distributed as dist

    table = {}
    for label, pg in groups.items():
        table[pg.group_name] = {"label": label, "ranks": dist.get_process_group_ranks(pg)}
    return table


class FlightDumper:
    """The worker side (see the module docstring). ``start()`` once the process groups exist."""

    def __init__(self, directory: str | Path, rank: int, groups: dict[str, dict[str, Any]], coords: dict[str, int]):
        self.directory, self.rank, self.groups, self.coords = Path(directory), rank, groups, coords
        self._seen = self._mtime()
        self._stop = threading.Event()

    def _mtime(self) -> float:
        try:
            return request_path(self.directory, self.rank).stat().st_mtime
        except FileNotFoundError:
            return 0.0

    def start(self) -> FlightDumper:
        self.directory.mkdir(parents=True, exist_ok=True)
        threading.Thread(target=self._run, name="stalwart-flight-dumper", daemon=True).start()
        ready_path(self.directory, self.rank).write_text(str(os.getpid()))
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            mtime = self._mtime()
            if mtime > self._seen:
                self._seen = mtime
                self.dump()

    def dump(self) -> Path:
        body = {"rank": self.rank, "coords": self.coords, "groups": self.groups, "time": time.time()}
        try:
            body["fr"] = _compat.flight_recorder_dump()
        except Exception as err:  # a torch without the recorder: say so instead of staying silent
            body["error"] = f"{type(err).__name__}: {err}"
        path = dump_path(self.directory, self.rank)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, path)
        return path


def collect(directory: str | Path, ranks: list[int], timeout_s: float = 3.0) -> dict[int, dict[str, Any]]:
    """The agent side: ask ``ranks`` for a dump and wait (bounded) for the answers; rank → dump, a
    rank that did not answer in time is absent."""
    directory = Path(directory)
    asked = time.time()
    for rank in ranks:
        request_path(directory, rank).write_text(str(asked))
    out: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < len(ranks) and time.monotonic() < deadline:
        for rank in ranks:
            if rank in out:
                continue
            try:
                body = json.loads(dump_path(directory, rank).read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if body.get("time", 0) >= asked:
                out[rank] = body
        time.sleep(0.1)
    return out


def start_for_worker(groups: dict[str, Any], coords: dict[str, int]) -> FlightDumper | None:
    """Start this worker's dumper when it runs under `stalwart run` (a progress directory is set);
    ``groups``: label → ProcessGroup (``{"dp": ..., "pp": ...}``), the world is added as ``world``."""
    import torch.distributed as dist

    from stalwart.runtime import worker_env

    directory = worker_env().progress_dir
    if not directory or not dist.is_initialized():
        return None
    table = group_table({"world": dist.group.WORLD, **groups})
    return FlightDumper(directory, dist.get_rank(), table, coords).start()

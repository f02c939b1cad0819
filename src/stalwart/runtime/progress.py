"""The worker's half of the progress channel: one tiny memory-mapped record per rank, plus incidents.

`report(step, loss=...)` writes step, wall time, phase and loss into a 64-byte record with a seqlock
(an odd sequence number means "being written"), so a step costs one `struct.pack_into` and no system
call, let alone a network round trip. The node agent (``stalwart.launch.progress.ProgressReader``)
reads every rank's record when it heartbeats and when it checks for hangs. Extra metrics go to a
per-rank JSONL file, flushed at most once a second, for the agent to forward in batches.

Incidents (a rollback, a hardware fault found by the worker itself) are rare and must not be lost:
`incident(...)` appends one JSON line to ``rank<r>.incidents.jsonl`` at once, and the agent forwards
them to the job journal.

The directory and rank come from ``worker_env()`` (``STALWART_PROGRESS_DIR``, ``RANK``), read on first
use. Without a stalwart agent every call is a cheap no-op.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalwart.runtime.env import worker_env

# -- the record format (shared with the agent's reader) ---------------------------------------------
# "done": the rank reports no more steps (``finished``); "returned": its script returned with exit code 0
# and the process is ending (``lifetime``): neither is a hang, and a finished job is never redone.
PHASES = ("init", "train", "checkpoint", "eval", "done", "returned")
# The sequence number (offset 0, 8-byte aligned) is stored and loaded through a memoryview cast to "Q":
# one 8-byte machine store/load. Not struct.pack_into: it zero-fills its target before writing, so a
# reader could catch seq = 0 (even, "consistent") twice around a half-written body and accept it.
SEQ = struct.Struct("<Q")


def seq_view(buf: mmap.mmap) -> memoryview:
    """The record's sequence number as one native unsigned 64-bit word (release before closing ``buf``)."""
    return memoryview(buf)[: SEQ.size].cast("Q")


BODY = struct.Struct("<qdIxxxxdQd")  # step, time, phase, pad, loss, steps_reported, compute_s
SIZE = 64
assert SEQ.size + BODY.size <= SIZE


def record_path(directory: str | Path, rank: int) -> Path:
    """The rank's progress record."""
    return Path(directory) / f"rank{rank}.progress"


def metrics_path(directory: str | Path, rank: int) -> Path:
    """The rank's extra metrics, JSON lines."""
    return Path(directory) / f"rank{rank}.metrics.jsonl"


def incidents_path(directory: str | Path, rank: int) -> Path:
    """The rank's incidents, JSON lines."""
    return Path(directory) / f"rank{rank}.incidents.jsonl"


def fault_path(directory: str | Path, rank: int) -> Path:
    """When a chaos fault fired in the rank (its wall time, for an exact MTTR)."""
    return Path(directory) / f"rank{rank}.fault"


# -- the writer -------------------------------------------------------------------------------------
class ProgressWriter:
    """The worker side. One per process; `report`/`phase`/`finished` create it through `writer()`."""

    def __init__(self, directory: str | Path, rank: int) -> None:
        path = record_path(directory, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.rank, self.pid = rank, os.getpid()
        # Continue the sequence of a previous writer of this record (a restarted worker): starting
        # over at 0 would let a reader see the same even number before and after a torn copy.
        self._seqword = seq_view(self._map)
        previous = self._seqword[0]
        self._seq = previous + (previous % 2)
        self._step, self._phase, self._loss, self._reports, self._compute = -1, 0, math.nan, 0, math.nan
        self._metrics_path = metrics_path(directory, rank)
        self._pending: list[str] = []
        self._flushed = time.monotonic()
        self._publish()

    def _publish(self) -> None:
        self._seq += 1  # odd: write in progress
        self._seqword[0] = self._seq
        BODY.pack_into(
            self._map, SEQ.size, self._step, time.time(), self._phase, self._loss, self._reports, self._compute
        )
        self._seq += 1  # even: consistent
        self._seqword[0] = self._seq

    def report(self, step: int, loss: float | None = None, compute_s: float | None = None, **metrics: Any) -> None:
        self._step, self._reports = step, self._reports + 1
        self._loss = math.nan if loss is None else float(loss)
        self._compute = math.nan if compute_s is None else float(compute_s)
        if self._phase == 0:
            self._phase = 1  # a report means training has started
        self._publish()
        if metrics:
            self._pending.append(json.dumps({"step": step, "time": time.time(), "loss": loss, **metrics}))
            if time.monotonic() - self._flushed > 1.0:
                self.flush()

    def set_phase(self, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; use one of {PHASES}")
        self._phase = PHASES.index(phase)
        self._publish()

    def flush(self) -> None:
        if self._pending:
            with open(self._metrics_path, "a") as f:
                f.write("\n".join(self._pending) + "\n")
            self._pending.clear()
        self._flushed = time.monotonic()


_writer: ProgressWriter | None = None
_resolved = False


def writer() -> ProgressWriter | None:
    """This process's writer, created on first use when an agent set ``STALWART_PROGRESS_DIR``."""
    global _writer, _resolved
    if not _resolved:
        _resolved = True
        env = worker_env()
        if env.progress_dir:
            _writer = ProgressWriter(env.progress_dir, env.rank)
            from stalwart.runtime.lifetime import watch_interpreter_exit  # lifetime imports this module

            watch_interpreter_exit()  # a cold-started worker's end is bounded too
    return _writer


def reset_writer() -> None:
    """Forget the writer (a zygote's forked child has its own rank and directory)."""
    global _writer, _resolved
    _writer, _resolved = None, False


# -- the worker API (re-exported as stalwart.report, ...) -------------------------------------------
def report(step: int, loss: float | None = None, compute_s: float | None = None, **metrics: Any) -> None:
    """Tell the agent that `step` completed (call once per optimizer step, after it). `compute_s`:
    the step's own work without communication waits (e.g. from `observe.timers.SectionTimer`),
    which lets the master spot a slow node although synchronous training paces every rank alike."""
    w = writer()
    if w is not None:
        w.report(step, loss, compute_s, **metrics)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a long non-step phase (checkpoint, eval) so hang detection allows for it."""
    w = writer()
    if w is None:
        yield
        return
    w.set_phase(name)
    try:
        yield
    finally:
        w.set_phase("train")


def finished() -> None:
    """This rank will report no more steps (teardown may take a while without being a hang)."""
    w = writer()
    if w is not None:
        w.set_phase("done")


def returned() -> None:
    """The script returned with exit code 0: what is left is the process's end, not training (called
    by ``lifetime`` only; a process that never reported gets no record)."""
    if _writer is not None and _writer.pid == os.getpid():  # not a forked child's (a DataLoader worker's) end
        _writer.set_phase("returned")


def _strict(value: Any) -> Any:
    """Non-finite floats as "nan"/"inf" strings: strict JSON for any reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def incident(kind: str, cls: str = "training", step: int | None = None, **detail: Any) -> bool:
    """Journal an incident the worker detected itself (``kind`` e.g. rollback, rollback_limit, sdc;
    ``cls`` training | hardware | ...). Appends ``{"time", "rank", "kind", "class", "step", "detail"}``
    as one line to ``$STALWART_PROGRESS_DIR/rank<RANK>.incidents.jsonl`` for the agent to forward;
    returns False (and writes nothing) without an agent. ``detail`` must be JSON-serialisable."""
    env = worker_env()
    if not env.progress_dir:
        return False
    line = json.dumps(
        {"time": time.time(), "rank": env.rank, "kind": kind, "class": cls, "step": step, "detail": _strict(detail)}
    )
    path = incidents_path(env.progress_dir, env.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
    return True


def fault_fired(when: float | None = None) -> None:
    """Record when an injected fault began in this rank (the agent reads it for an exact MTTR); a no-op
    without an agent."""
    env = worker_env()
    if env.progress_dir:
        fault_path(env.progress_dir, env.rank).write_text(repr(time.time() if when is None else when))

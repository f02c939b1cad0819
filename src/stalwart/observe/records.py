"""Per-rank, per-step records: every rank writes its own ``rank{R}.jsonl`` in the run's ``ranks/``
directory, one JSON object per applied step, milliseconds throughout:

    {"step": 7, "rank": 1, "time": <wall clock at step start, s>, "ms": {"data": 0.4, "forward": 12.1,
     "backward": 20.3, "grad_clip": 0.2, "optimizer": 3.0, "checkpoint": 1.1, "step": 38.0, <user>...},
     "compute_ms": ..., "wait_ms": ..., "spans": [[name, start_ms, dur_ms], ...], "tokens": ...,
     "tokens_per_s": ..., "loss": ..., "grad_norm": ..., "lr": ..., "mfu": ..., "mem_mb": ...}

A step's record joins two halves that become known at different times on a GPU — its section times
(CUDA events, resolved a step late) and its loss/grad norm (an asynchronous host copy) — and is
written once both are in (``flush(force=True)`` writes what is there). Each complete record is
written at once (one ``write`` per step, no fsync: a rank killed by its launcher after a peer died
must not lose its last steps, the ones a post-mortem needs); no network call ever: the agent or
``stalwart trace export`` read the files where they lie. ``rank{R}.meta.json`` says where the
rank sits in the mesh (``coords``), its host and pid, for the merged timeline.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stalwart.observe.histo import SectionHistograms

RANKS_DIR = "ranks"
# a pipeline stage's forward of one micro-batch (timers.StageForwards records it, nested in "pipeline";
# trace.py draws it): here, not in timers, so readers of records need not import torch
STAGE_FORWARD = "pp_fwd_s{}"
FLUSH_EVERY_S = 0.0  # write each record as it completes (see above)


def records_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank{rank}.jsonl"


def meta_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / RANKS_DIR / f"rank{rank}.meta.json"


def sections_ms(sections: dict[str, Any]) -> dict[str, Any]:
    """A SectionTimer result (seconds) → the record's ``ms``/``compute_ms``/``wait_ms``/``spans``."""
    ms = {k: round(v * 1e3, 3) for k, v in sections.items() if k not in ("compute_s", "wait_s", "step", "spans")}
    out: dict[str, Any] = {
        "ms": ms,
        "compute_ms": round(sections.get("compute_s", 0.0) * 1e3, 3),
        "wait_ms": round(sections.get("wait_s", 0.0) * 1e3, 3),
    }
    if "spans" in sections:
        out["spans"] = sections["spans"]
    return out


class RankRecords:
    """This rank's record writer (see the module docstring)."""

    def __init__(
        self,
        run_dir: str | Path,
        rank: int,
        coords: dict[str, int],
        append: bool = False,
        hist_dir: str | Path | None = None,
    ) -> None:
        self.path = records_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        dirs = [self.path.parent, *([hist_dir] if hist_dir else [])]  # hist_dir: the agent's progress dir
        self.hist = SectionHistograms(rank, dirs, resume=append, stage=coords.get("pp", 0))
        if append:
            self._catch_up()
        self.rank = rank
        meta = {"rank": rank, "coords": coords, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        meta_path(run_dir, rank).write_text(json.dumps(meta))
        self._file = open(self.path, "a" if append else "w")
        if append and _ends_torn(self.path):  # a killed writer's last line: end it, keep it unreadable
            self._file.write("\n")
        self._partial: dict[int, dict[str, Any]] = {}  # step → what is known so far
        self._halves: dict[int, int] = {}  # step → halves in (2 = complete)
        self._lines: list[str] = []
        self._flushed = time.monotonic()

    def _catch_up(self) -> None:
        """A restarted rank: fold into the resumed histograms the records its predecessor wrote after
        their last publish (from the byte offset they cover: the tail only)."""
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(min(self.hist.offset, os.path.getsize(self.path)))
            for line in f:
                try:
                    self.hist.add(json.loads(line), publish=False)
                except json.JSONDecodeError:
                    continue
            self.hist.offset = f.tell()

    def _add(self, step: int, part: dict[str, Any]) -> None:
        record = self._partial.setdefault(step, {"step": step, "rank": self.rank})
        self._halves[step] = self._halves.get(step, 0) + 1
        ms = part.pop("ms", None)  # host-side sections (checkpoint, step) join the timer's
        record.update(part)
        if ms is not None:
            record.setdefault("ms", {}).update(ms)
        if self._halves[step] == 2:
            self._emit(step)

    def add_values(self, step: int, values: dict[str, Any]) -> None:
        """The host half: time, loss, grad norm, lr, tokens, tokens/s, MFU, memory, host sections."""
        self._add(step, dict(values))

    def add_sections(self, sections: dict[str, Any]) -> None:
        """The timer half: a ``SectionTimer`` result that carries its ``step``."""
        self._add(sections["step"], sections_ms(sections))

    def _emit(self, step: int) -> None:
        self._halves.pop(step, None)
        record = self._partial.pop(step)
        self._lines.append(json.dumps(record))
        if time.monotonic() - self._flushed >= FLUSH_EVERY_S:
            self.flush()
        self.hist.add(record)  # after the flush: its offset covers this record

    def flush(self, force: bool = False) -> None:
        """Write buffered lines; ``force``: also records still missing a half (a failure, the end)."""
        if force:
            for step in sorted(self._partial):
                self._emit(step)
        if self._lines:
            self._file.write("\n".join(self._lines) + "\n")
            self._file.flush()
            self._lines.clear()
            self.hist.offset = self._file.tell()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self.flush(force=True)
        self.hist.publish()
        self._file.close()


def _ends_torn(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def read_records(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Every rank's records under ``run_dir`` (its ``ranks/`` or any ``*/ranks/`` below), in file order;
    a torn last line (a killed writer) is skipped. Steps redone after a restart appear again."""
    for path in rank_files(run_dir):
        for line in path.read_text().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def rank_files(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir)
    return sorted(set(root.glob(f"{RANKS_DIR}/rank*.jsonl")) | set(root.glob(f"**/{RANKS_DIR}/rank*.jsonl")))


def read_meta(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """rank → its meta (coords, host, pid) from the newest ``rank{R}.meta.json`` found."""
    root = Path(run_dir)
    out: dict[int, dict[str, Any]] = {}
    paths = set(root.glob(f"{RANKS_DIR}/rank*.meta.json")) | set(root.glob(f"**/{RANKS_DIR}/rank*.meta.json"))
    for path in sorted(paths, key=lambda p: p.stat().st_mtime):
        try:
            meta = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out[int(meta["rank"])] = meta
    return out

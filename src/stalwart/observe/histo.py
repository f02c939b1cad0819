"""Per-rank step/section histograms (ms buckets) for the master's ``/metrics``.

Each rank folds its step records into cumulative histograms and replaces ``rank{R}.hist.json`` in
its records directory and, under `stalwart run`, in ``PROGRESS_DIR`` every ``PUBLISH_S`` and at every
``PUBLISH_STEPS``-th step (local files, no network call; the step rule keeps the ranks' newest steps,
which the master compares across ranks, in phase). A restarted rank resumes from the records directory's copy (the
agent wipes PROGRESS_DIR on a restart), so the counts stay cumulative over restarts; the node
agent's heartbeat carries its ranks' PROGRESS_DIR files to the master, which exports them as Prometheus
histograms per node and rank. Buckets are in milliseconds: Prometheus' 15-60 s scrapes still see a
single 200 ms stall, in its bucket. The rank's ``SLOWEST`` slowest steps ride along (step, whole-step
ms, longest section), so the dashboard names a stall's exact (step, rank).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

from stalwart.observe import stragglers

BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)  # plus +Inf
PUBLISH_S = 2.0
PUBLISH_STEPS = 10  # also at every 10th step: all ranks then publish the same newest steps
SLOWEST = 5  # slowest steps kept per rank
RECENT = 20  # newest steps' compute and wait sections, for the master's live straggler scores


def hist_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.hist.json"


class SectionHistograms:
    """Cumulative per-section histograms of one rank: ``counts[i]`` = samples ≤ ``BUCKETS_MS[i]``'s
    bucket (non-cumulative per bucket; the last is +Inf), plus sum and count."""

    def __init__(
        self, rank: int, directories: list[str | Path] | None = None, resume: bool = False, stage: int = 0
    ) -> None:
        self.rank, self.directories, self.stage = rank, [Path(d) for d in directories or []], stage
        for d in self.directories:
            d.mkdir(parents=True, exist_ok=True)
        self.sections: dict[str, dict[str, Any]] = {}
        self.offset = 0  # bytes of the rank's records file these counts cover (set by RankRecords)
        self.last: dict[str, Any] = {}  # the newest record's step, loss, tokens/s, MFU (the dashboard's curves)
        self.slowest: list[dict[str, Any]] = []  # {step, ms, section, section_ms}, slowest first
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)  # {step, ms: {section: ms}}, oldest first
        self._published = 0.0
        if resume and self.directories:
            self._load(hist_path(self.directories[0], rank))

    def _load(self, path: Path) -> None:
        try:
            body = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return
        if body.get("buckets_ms") == list(BUCKETS_MS):
            self.sections, self.offset = body["sections"], int(body.get("offset", 0))
            self.slowest = list(body.get("slowest", []))

    def add(self, record: dict[str, Any], publish: bool = True) -> None:
        self.last = {k: record[k] for k in ("step", "time", "loss", "tokens_per_s", "mfu") if k in record}
        for name, ms in (record.get("ms") or {}).items():
            h = self.sections.setdefault(name, {"counts": [0] * (len(BUCKETS_MS) + 1), "sum": 0.0, "count": 0})
            h["counts"][next((i for i, b in enumerate(BUCKETS_MS) if ms <= b), len(BUCKETS_MS))] += 1
            h["sum"] += ms
            h["count"] += 1
        self._note_slow(record)
        scored = {k: round(v, 2) for k, v in (record.get("ms") or {}).items() if k in stragglers.SECTIONS}
        if scored and "step" in record:
            self.recent.append({"step": record["step"], "ms": scored})
        due = time.monotonic() - self._published >= PUBLISH_S or record.get("step", 1) % PUBLISH_STEPS == 0
        if publish and self.directories and due:
            self.publish()

    def _note_slow(self, record: dict[str, Any]) -> None:
        ms = record.get("ms") or {}
        if "step" not in ms or "step" not in record:
            return
        if len(self.slowest) >= SLOWEST and ms["step"] <= self.slowest[-1]["ms"]:
            return
        sections = {k: v for k, v in ms.items() if k != "step"}
        longest = max(sections, key=sections.get, default=None)
        row = {"step": record["step"], "ms": ms["step"], "section": longest, "section_ms": sections.get(longest)}
        kept = [r for r in self.slowest if r["step"] != record["step"] or r["ms"] > row["ms"]]  # a redone step: once
        if all(r["step"] != record["step"] for r in kept):
            kept.append(row)
        self.slowest = sorted(kept, key=lambda r: -r["ms"])[:SLOWEST]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "buckets_ms": list(BUCKETS_MS),
            "sections": self.sections,
            "offset": self.offset,
            "last": self.last,
            "slowest": self.slowest,
            "recent": list(self.recent),
            "stage": self.stage,
            "time": time.time(),
        }

    def publish(self) -> None:
        """Replace the rank's histogram files (atomic: the agent never reads half of one)."""
        text = json.dumps(self.to_dict())
        for directory in self.directories:
            path = hist_path(directory, self.rank)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, path)
        self._published = time.monotonic()


def read_node(directory: str | Path) -> dict[str, dict[str, Any]]:
    """The agent side: rank (as a string, JSON keys) → its latest histograms."""
    out = {}
    for path in sorted(Path(directory).glob("rank*.hist.json")):
        try:
            body = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        out[str(body["rank"])] = body
    return out


def cumulative(counts: list[int]) -> list[tuple[str, int]]:
    """Prometheus buckets: (le, cumulative count), +Inf last."""
    out, total = [], 0
    for le, n in zip([*map(str, BUCKETS_MS), "+Inf"], counts):
        total += n
        out.append((le, total))
    return out

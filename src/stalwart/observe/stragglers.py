"""Straggler scores per rank and section from the step records (NVRx's two views).

For each section, a rank's median over its newest ``window`` steps is compared with

* its peers: ``peer`` = rank median / median over all ranks (1.0 = typical; 1.3 = 30 % slower);
* itself: ``self`` = rank median / the rank's own best windowed median so far (a rank that got
  slower than it used to be, even if every rank did).

A rank is *flagged* when a compute section (one of ``COMPUTE``, not a wait) is ``threshold`` × its
peers' median and at least ``min_excess_ms`` longer (a 1 ms section that takes 2 ms is noise).
Waits are not flagged: the ranks that only wait for a slow one show long waits (``backward``,
``grad_clip``) while their own compute is normal; their wait sections' ``peer`` scores say so.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

COMPUTE = ("data", "forward", "optimizer", "pipeline")
WAIT = ("backward", "grad_clip")


def scores(
    records: list[dict[str, Any]], window: int = 10, threshold: float = 1.2, min_excess_ms: float = 5.0
) -> dict[str, Any]:
    """``{"ranks": {rank: {section: {"peer": x, "self": y}}}, "flagged": {rank: [sections]}}``."""
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.get("time", 0.0), r["step"])):
        by_rank[r["rank"]].append(r)
    medians: dict[int, dict[str, float]] = {}
    best: dict[int, dict[str, float]] = {}
    for rank, recs in by_rank.items():
        best[rank] = {}
        for end in range(window, len(recs) + 1, window):  # the rank's own history of windowed medians
            for section, value in _window_medians(recs[end - window : end]).items():
                best[rank][section] = min(best[rank].get(section, value), value)
        medians[rank] = _window_medians(recs[-window:])
    out: dict[int, dict[str, dict[str, float]]] = {}
    flagged: dict[int, list[str]] = {}
    sections = {s for m in medians.values() for s in m}
    for section in sorted(sections):
        values = [m[section] for m in medians.values() if section in m]
        typical = statistics.median(values)
        for rank, m in medians.items():
            if section not in m or typical <= 0:
                continue
            own_best = best[rank].get(section) or m[section]
            score = {"peer": round(m[section] / typical, 3), "self": round(m[section] / own_best, 3)}
            out.setdefault(rank, {})[section] = score
            if section in COMPUTE and score["peer"] >= threshold and m[section] - typical >= min_excess_ms:
                flagged.setdefault(rank, []).append(section)
    return {"ranks": out, "flagged": flagged, "window": window, "threshold": threshold}


def _window_medians(recs: list[dict[str, Any]]) -> dict[str, float]:
    values: dict[str, list[float]] = defaultdict(list)
    for r in recs:
        for section, ms in (r.get("ms") or {}).items():
            if section in COMPUTE or section in WAIT:
                values[section].append(ms)
    return {s: statistics.median(v) for s, v in values.items()}

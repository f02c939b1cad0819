"""The master's live per-section straggler scores, from the newest steps the heartbeats bring.

Each heartbeat carries the node's ranks' histogram files (``observe.histo``), whose ``recent`` lists hold
the section times of each rank's newest steps. The master merges them per rank (one beat may catch rank
0's file a publish ahead of rank 1's; together they cover the same steps) and scores them with
``observe.stragglers.live`` at most every ``SCORES_S``: status and the dashboard read the cached result.
"""

from __future__ import annotations

import threading
from typing import Any

from stalwart.observe import stragglers as section_scores

SCORES_S = 2.0  # the ranks publish their histogram files every 2 s (observe.histo.PUBLISH_S)
KEEP_STEPS = 40  # newest steps per rank kept for the section scores (2 windows of 10, twice over)


class RecentSteps:
    def __init__(self) -> None:
        self._recent: dict[int, dict[int, dict[str, float]]] = {}  # rank → step → section ms (newest KEEP)
        self._rank_of: dict[int, tuple[str, int]] = {}  # rank → (its node, its pipeline stage)
        self._lock = threading.Lock()  # heartbeats write, status reads (another thread)
        self._cache: tuple[float, dict[int, list[str]]] = (-SCORES_S, {})

    def note(self, node_id: str, hists: Any) -> None:
        """Merge one heartbeat's histogram files (``{name: {rank, stage, recent}}``) of ``node_id``."""
        if not isinstance(hists, dict):
            return
        with self._lock:
            for h in hists.values():
                if not isinstance(h, dict) or not isinstance(h.get("rank"), int):
                    continue
                rank = h["rank"]
                self._rank_of[rank] = (node_id, int(h.get("stage") or 0))
                steps = self._recent.setdefault(rank, {})
                for r in h.get("recent") or []:
                    steps[int(r["step"])] = r["ms"]
                for old in sorted(steps)[:-KEEP_STEPS]:
                    del steps[old]

    def flagged(self, alive: set[str], now: float) -> dict[int, list[str]]:
        """rank → its slow compute sections, over the ranks of the ``alive`` nodes (cached SCORES_S)."""
        if now - self._cache[0] >= SCORES_S:
            with self._lock:
                hists = [
                    {
                        "rank": rank,
                        "stage": stage,
                        "recent": [{"step": s, "ms": v} for s, v in self._recent[rank].items()],
                    }
                    for rank, (node, stage) in self._rank_of.items()
                    if node in alive
                ]
            self._cache = (now, section_scores.live(hists)["flagged"])
        return self._cache[1]

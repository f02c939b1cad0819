"""Straggler scores per rank and section from the step records (NVRx's two views).

For each section, over the newest ``window`` steps:

* ``peer``: the median over the window's steps of the rank's time / the median of its *peers'* times
  at the same step (1.0 = typical; 1.3 = 30 % slower). Step by step, so a slowdown of the whole host
  cancels out; against the others only (with two ranks, a median that includes the rank itself
  halves its excess). Peers are the ranks of its group (``groups``: e.g. the same pipeline stage,
  whose work differs from another stage's by design), all other ranks without groups;
* ``self``: the rank's median / its own best windowed median so far (a rank that got slower than it
  used to be, even if every rank did).

A rank is *flagged* when a compute section (one of ``COMPUTE``, not a wait) has ``peer`` ≥
``threshold`` and is at least ``min_excess_ms`` above its peers (a 1 ms section that takes 2 ms is
noise) in each of the newest ``persist`` windows: one window of a busy host's scheduling noise
(another process on the rank's core for a few steps) is not a straggler, a slowdown that lasts is.
So a rank slowed from step S is flagged at step S + ``persist`` × ``window`` at the latest.
Waits are not flagged: the ranks that only wait for a slow one show long waits (``backward``,
``grad_clip``) while their own compute is normal; their wait sections' ``peer`` scores say so.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Hashable
from typing import Any

COMPUTE = ("data", "forward", "optimizer", "pipeline")
WAIT = ("backward", "grad_clip")
SECTIONS = COMPUTE + WAIT


def scores(
    records: list[dict[str, Any]],
    window: int = 10,
    threshold: float = 1.2,
    min_excess_ms: float = 5.0,
    persist: int = 2,
    groups: dict[int, Hashable] | None = None,
) -> dict[str, Any]:
    """``{"ranks": {rank: {section: {"peer": x, "self": y}}}, "flagged": {rank: [sections]}}``."""
    if window < 1 or persist < 1:
        raise ValueError(f"straggler window and persist must be ≥ 1, got {window} and {persist}")
    by_step = _by_step(records)
    steps = [s for s in sorted(by_step) if len(by_step[s]) > 1]
    windows = [steps[max(0, len(steps) - (k + 1) * window) : len(steps) - k * window] for k in range(persist)]
    out: dict[int, dict[str, dict[str, float]]] = {}
    flagged: dict[int, list[str]] = {}
    best = _own_best(by_step, window)
    full = len(windows[-1]) == window  # enough history for `persist` whole windows
    groups = groups or {}
    peers = _peer_values(by_step, [s for w in windows for s in w], groups)
    for rank in sorted({r for at in by_step.values() for r in at}):
        judged = [_window_score(by_step, peers, w, rank, groups.get(rank)) for w in windows if w]
        for section, (peer, mine, _) in (judged[0] if judged else {}).items():
            own_best = best[rank].get(section) or mine
            out.setdefault(rank, {})[section] = {"peer": round(peer, 3), "self": round(mine / own_best, 3)}
            slow = [section in j and j[section][0] >= threshold and j[section][2] >= min_excess_ms for j in judged]
            if section in COMPUTE and full and len(judged) == persist and all(slow):
                flagged.setdefault(rank, []).append(section)
    return {"ranks": out, "flagged": flagged, "window": window, "threshold": threshold, "persist": persist}


def live(hists: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """``scores`` over the newest steps each rank's histogram file carries (``observe.histo``: the
    heartbeats bring them to the master), each rank judged against its pipeline stage."""
    records = [{"rank": h["rank"], **r} for h in hists for r in h.get("recent") or []]
    return scores(records, groups={h["rank"]: h.get("stage", 0) for h in hists}, **kw)


def _by_step(records: list[dict[str, Any]]) -> dict[int, dict[int, dict[str, float]]]:
    """step → rank → section ms (compute and wait sections); a step redone after a restart keeps
    its newest record."""
    out: dict[int, dict[int, dict[str, float]]] = defaultdict(dict)
    for r in sorted(records, key=lambda r: (r.get("time", 0.0), r["step"])):
        ms = {s: v for s, v in (r.get("ms") or {}).items() if s in SECTIONS}
        if ms:
            out[r["step"]][r["rank"]] = ms
    return out


def _peer_values(
    by_step: dict[int, dict[int, dict[str, float]]], steps: list[int], groups: dict[int, Hashable]
) -> dict[tuple[int, Hashable, str], list[float]]:
    """(step, group, section) → every rank's value, sorted: each rank's peers' median is then one
    lookup (``_median_without``), not a pass over all ranks — the master scores thousands."""
    out: dict[tuple[int, Hashable, str], list[float]] = defaultdict(list)
    for step in steps:
        for rank, ms in by_step[step].items():
            for section, value in ms.items():
                out[(step, groups.get(rank), section)].append(value)
    for values in out.values():
        values.sort()
    return out


def _median_without(values: list[float], mine: float) -> float | None:
    """The median of sorted ``values`` less one occurrence of ``mine`` (None if nothing is left)."""
    k, n = bisect.bisect_left(values, mine), len(values) - 1
    if n < 1:
        return None
    lo, hi = [values[i if i < k else i + 1] for i in (n // 2 - 1 + n % 2, n // 2)]  # the middle one or two
    return (lo + hi) / 2


def _window_score(
    by_step: dict[int, dict[int, dict[str, float]]],
    peers: dict[tuple[int, Hashable, str], list[float]],
    steps: list[int],
    rank: int,
    group: Hashable,
) -> dict[str, tuple[float, float, float]]:
    """section → (median step-by-step ratio to the peers' median, the rank's median ms, its excess ms
    over the peers' median) for ``rank`` over ``steps``."""
    ratios: dict[str, list[float]] = defaultdict(list)
    mine: dict[str, list[float]] = defaultdict(list)
    theirs: dict[str, list[float]] = defaultdict(list)
    for step in steps:
        for section, ms in by_step[step].get(rank, {}).items():
            typical = _median_without(peers[(step, group, section)], ms)
            if typical is not None and typical > 0:
                ratios[section].append(ms / typical)
                mine[section].append(ms)
                theirs[section].append(typical)
    return {
        s: (statistics.median(v), statistics.median(mine[s]), statistics.median(mine[s]) - statistics.median(theirs[s]))
        for s, v in ratios.items()
    }


def _own_best(by_step: dict[int, dict[int, dict[str, float]]], window: int) -> dict[int, dict[str, float]]:
    """rank → section → its best (lowest) median over consecutive windows of its own steps."""
    history: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for step in sorted(by_step):
        for rank, ms in by_step[step].items():
            for section, value in ms.items():
                history[rank][section].append(value)
    return {
        rank: {
            s: min(statistics.median(v[i : i + window]) for i in range(0, max(1, len(v) - window + 1), window))
            for s, v in sections.items()
        }
        for rank, sections in history.items()
    }

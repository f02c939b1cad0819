"""Who a hang waits for, from every rank's Flight Recorder dump (``stalwart.observe.flight``).

Per process group: each member's collectives by sequence id. The group is stuck at the lowest
sequence id some member entered and has not finished; members that entered it *wait*, members whose
last collective in the group is older *never entered* it — the ranks the hang is behind. For each
of those: its mesh coordinates and where it is instead (pending in another group's collective, or
outside any collective: data loading, user code, a frozen process). A *desync* — members at the same
sequence id with a different op or shape — is reported with both fingerprints. A rank with no dump
did not answer (stopped, dead, or stuck holding the GIL): named as such. torch's own ``fr_trace``
analyser needs ``pg_config`` (empty on gloo); the dumps here carry each group's ranks themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stalwart.observe import flight


def _fingerprint(entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "op": entry.get("profiling_name", "?"),
        "sizes": entry.get("input_sizes"),
        "dtypes": entry.get("input_dtypes"),
    }


def _coords_text(coords: dict[str, int]) -> str:
    return " ".join(f"{k}{v}" for k, v in coords.items())


def _by_group(dump: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """group name → sequence id → entry (collectives only; p2p has its own sequence)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for e in dump.get("fr", {}).get("entries", []):
        if not e.get("is_p2p"):
            out.setdefault(str(e["process_group"][0]), {})[int(e["collective_seq_id"])] = e
    return out


def _pending(entries: dict[str, dict[int, dict[str, Any]]]) -> list[tuple[str, int, str]]:
    return [
        (g, seq, e.get("profiling_name", "?"))
        for g, by in entries.items()
        for seq, e in by.items()
        if not e.get("retired")
    ]


def diagnose(dumps: dict[int, dict[str, Any]], expected: list[int] | None = None) -> dict[str, Any]:
    """``{"stuck": [per stuck group...], "desync": [...], "no_dump": [ranks], "summary": "..."}``."""
    groups: dict[str, dict[str, Any]] = {}
    coords: dict[int, dict[str, int]] = {}
    for rank, d in dumps.items():
        groups.update(d.get("groups", {}))
        coords[rank] = d.get("coords", {})
    entries = {rank: _by_group(d) for rank, d in dumps.items()}
    no_dump = sorted(set(expected or []) - set(dumps))
    stuck, desyncs = [], []
    for name, info in sorted(groups.items(), key=lambda kv: kv[1]["label"]):
        members = info["ranks"]
        seqs = {r: entries[r].get(name, {}) for r in members if r in entries}
        open_seqs = [s for by in seqs.values() for s, e in by.items() if not e.get("retired")]
        for seq in sorted({s for by in seqs.values() for s in by}):  # first op/shape mismatch in the group
            prints = {r: _fingerprint(by[seq]) for r, by in seqs.items() if seq in by}
            if len({repr(p) for p in prints.values()}) > 1:
                desyncs.append({"group": info["label"], "group_name": name, "seq": seq, "fingerprints": prints})
                break
        if not open_seqs:
            continue
        seq = min(open_seqs)
        waiting = sorted(r for r, by in seqs.items() if seq in by and not by[seq].get("retired"))
        behind = sorted(r for r, by in seqs.items() if max(by, default=0) < seq)
        op = next(seqs[r][seq].get("profiling_name", "?") for r in waiting)
        missing = []
        for r in behind:
            elsewhere = [p for p in _pending(entries[r]) if p[0] != name]
            where = (
                f"in {groups.get(elsewhere[0][0], {}).get('label', elsewhere[0][0])} collective #{elsewhere[0][1]} "
                f"({elsewhere[0][2]})"
                if elsewhere
                else "outside any collective (data loading, user code or a frozen process)"
            )
            last = max(seqs[r], default=0)
            missing.append({"rank": r, "coords": coords.get(r, {}), "last_seq": last, "where": where})
        missing += [{"rank": r, "coords": {}, "last_seq": None, "where": "no dump"} for r in members if r in no_dump]
        stuck.append(
            {"group": info["label"], "group_name": name, "ranks": members, "seq": seq, "op": op}
            | {"waiting": waiting, "missing": missing}
        )
    return {"stuck": stuck, "desync": desyncs, "no_dump": no_dump, "summary": summarize(stuck, desyncs, no_dump)}


def summarize(stuck: list[dict[str, Any]], desyncs: list[dict[str, Any]], no_dump: list[int]) -> str:
    lines = []
    for s in stuck:
        who = ", ".join(f"rank {m['rank']} [{_coords_text(m['coords'])}] ({m['where']})" for m in s["missing"])
        lines.append(
            f"group {s['group']} (ranks {s['ranks']}) collective #{s['seq']} {s['op']}: "
            f"{who or 'every member entered'} never entered; ranks {s['waiting']} wait on it"
        )
    for d in desyncs:
        prints = "; ".join(f"rank {r}: {p['op']} {p['sizes']}" for r, p in d["fingerprints"].items())
        lines.append(f"desync in group {d['group']} at collective #{d['seq']}: {prints}")
    if no_dump:
        lines.append(f"no flight-recorder dump from ranks {no_dump} (stopped, dead or holding the GIL)")
    return "\n".join(lines) or "no collective is pending on any rank that answered"


def hang_collectives(progress_dir: str | Path, ranks: list[int], timeout_s: float = 3.0) -> dict[str, Any]:
    """The agent's call on a hang, before it kills the workers: ask its ranks that run a
    ``FlightDumper`` for their Flight Recorder dumps (bounded wait) and diagnose them; without any
    such rank (a script that starts none) it returns at once, so a hang's recovery waits for nothing."""
    asked = flight.with_dumper(progress_dir, ranks)
    if not asked:
        return {"stuck": [], "desync": [], "no_dump": [], "summary": "no flight-recorder dumper in these ranks"}
    return diagnose(flight.collect(progress_dir, asked, timeout_s), expected=asked)

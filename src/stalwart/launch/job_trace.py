"""The job's merged timeline from what one host can see: the rank records under some directories and
the journal's incidents and decisions. Shared by `stalwart trace export` and the master's
``GET /v1/trace`` (the dashboard's download), so both give the same trace."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stalwart.launch.journal import INCIDENT_TIMES, Journal
from stalwart.observe.records import read_meta, read_records
from stalwart.observe.trace import build_trace


def rollbacks(roots: Iterable[Path]) -> list[dict[str, Any]]:
    """Rollbacks from rank 0's metrics.jsonl (attached to the step after them)."""
    out = []
    for root in roots:
        for path in sorted({*root.glob("metrics.jsonl"), *root.glob("**/metrics.jsonl")}):
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec.get("rollback"), dict) and "time" in rec:
                    out.append({"time": rec["time"], "step": rec.get("step"), **rec["rollback"]})
    return out


def job_trace(
    roots: list[Path], incidents: list[dict[str, Any]], decisions: list[dict[str, Any]], view: str = "pp"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the Chrome-trace dict, counts of what went into it). ``roots``: directories holding rank
    records (``ranks/`` at any depth) and rank 0's metrics.jsonl."""
    records = [r for root in roots for r in read_records(root)]
    meta = {rank: m for root in roots for rank, m in read_meta(root).items()}
    trace = build_trace(records, meta, incidents, decisions, rollbacks(roots), view, INCIDENT_TIMES)
    counts = {
        "ranks": len({r["rank"] for r in records}),
        "step_records": len(records),
        "incidents": len(incidents),
        "decisions": len(decisions),
        "events": len(trace["traceEvents"]),
        "clock_offsets_ms": trace["otherData"]["clock_offsets_ms"],
    }
    return trace, counts


def master_trace(journal: Journal) -> dict[str, Any]:
    """``GET /v1/trace``: the journal's job with the rank records under the journal's run directory —
    every rank where ``train.out_dir`` lies there on a filesystem the nodes share, else the master
    host's ranks (``stalwart trace export --records`` merges other hosts' copies)."""
    return job_trace([journal.path.parent], journal.incidents(), journal.decisions())[0]

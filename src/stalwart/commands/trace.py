"""`stalwart trace export RUN_DIR -o trace.json`: the whole job on one Chrome-trace / Perfetto timeline."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace",
        help="export the job's merged timeline (Chrome trace JSON, opens in Perfetto)",
        description="Merge every rank's step records (OUT_DIR/ranks/, written by `stalwart train`) and "
        "the job's journal (RUN_DIR/journal.sqlite, written by `stalwart run`'s master) into one "
        "Chrome-trace JSON: a track per rank named with its mesh coordinates, steps and their "
        "sections as complete events, incidents, decisions and rollbacks as instant events. Open "
        "it at https://ui.perfetto.dev or chrome://tracing.",
    )
    actions = p.add_subparsers(dest="trace_action", required=True, metavar="ACTION")
    e = actions.add_parser("export", help="write the merged trace", description="Write the merged trace JSON.")
    e.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run directory (`stalwart run --run-dir`)")
    e.add_argument("-o", "--output", type=Path, required=True, help="where to write the trace JSON")
    e.add_argument(
        "--records",
        type=Path,
        action="append",
        default=None,
        help="a directory with rank records (train.out_dir) outside RUN_DIR; repeatable (default: RUN_DIR)",
    )
    e.add_argument("--view", choices=("pp", "dp", "tp"), default="pp", help="track order: this axis first (default pp)")
    e.add_argument("--json", action="store_true", help="print a summary of the export as one JSON object")
    e.set_defaults(handler=run)


def _rollbacks(roots: list[Path]) -> list[dict[str, Any]]:
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


def run(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from stalwart.commands.common import emit
    from stalwart.launch.journal import INCIDENT_TIMES, Journal
    from stalwart.observe.records import read_meta, read_records
    from stalwart.observe.trace import build_trace

    if not args.run_dir.is_dir():
        raise ValueError(f"{args.run_dir} is not a directory; pass the run directory of a job")
    roots = [args.run_dir, *(args.records or [])]
    records = [r for root in roots for r in read_records(root)]
    meta = {rank: m for root in roots for rank, m in read_meta(root).items()}
    incidents: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    journal_path = args.run_dir / "journal.sqlite"
    if journal_path.exists():
        journal = Journal(journal_path)
        try:
            incidents, decisions = journal.incidents(), journal.decisions()
        finally:
            journal.close()
    if not records and not incidents:
        raise ValueError(
            f"no rank records (ranks/rank*.jsonl) and no journal under {args.run_dir}; "
            "pass --records TRAIN_OUT_DIR when train.out_dir lies outside the run directory"
        )
    trace = build_trace(records, meta, incidents, decisions, _rollbacks(roots), args.view, INCIDENT_TIMES)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(trace))
    summary = {
        "output": str(args.output),
        "ranks": len({r["rank"] for r in records}),
        "step_records": len(records),
        "incidents": len(incidents),
        "decisions": len(decisions),
        "events": len(trace["traceEvents"]),
        "clock_offsets_ms": trace["otherData"]["clock_offsets_ms"],
    }
    emit(summary, args.json, "trace export")
    return 0

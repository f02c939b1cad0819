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


def run(args: argparse.Namespace, overrides: dict, argv: list[str]) -> int:
    from stalwart.commands.common import emit
    from stalwart.launch.job_trace import job_trace
    from stalwart.launch.journal import Journal

    if not args.run_dir.is_dir():
        raise ValueError(f"{args.run_dir} is not a directory; pass the run directory of a job")
    roots = [args.run_dir, *(args.records or [])]
    incidents: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    journal_path = args.run_dir / "journal.sqlite"
    if journal_path.exists():
        journal = Journal(journal_path)
        try:
            incidents, decisions = journal.incidents(), journal.decisions()
        finally:
            journal.close()
    trace, counts = job_trace(roots, incidents, decisions, args.view)
    if not counts["step_records"] and not incidents:
        raise ValueError(
            f"no rank records (ranks/rank*.jsonl) and no journal under {args.run_dir}; "
            "pass --records TRAIN_OUT_DIR when train.out_dir lies outside the run directory"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(trace))
    emit({"output": str(args.output), **counts}, args.json, "trace export")
    return 0

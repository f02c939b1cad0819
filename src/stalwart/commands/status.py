"""`stalwart status [RUN_DIR | --master URL] [--json]`: where a job stands, live or after the fact."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="a job's state, step, tokens/s, MFU, nodes, incidents and hang/straggler diagnosis",
        description="Show where a job stands: asks its master (RUN_DIR/master.json or --master) when it "
        "runs, else reads RUN_DIR/journal.sqlite; adds the ranks' step records (OUT_DIR/ranks/) and "
        "summary.json found under RUN_DIR or --records.",
    )
    p.add_argument(
        "run_dir", type=Path, nargs="?", metavar="RUN_DIR", help="the run directory (`stalwart run --run-dir`)"
    )
    p.add_argument("--master", help="the master's URL (e.g. http://127.0.0.1:29600), instead of RUN_DIR")
    p.add_argument("--job-token", help="the job token (default: RUN_DIR/token or $STALWART_JOB_TOKEN)")
    p.add_argument("--records", type=Path, help="train.out_dir when it lies outside RUN_DIR")
    p.add_argument("--incidents", type=int, default=5, help="how many recent incidents to show (default 5)")
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")
    p.set_defaults(handler=run)


def _master_status(args: argparse.Namespace) -> tuple[dict[str, Any] | None, bool]:
    """(status, live): the running master's answer, else the journal's content, else (None, False)."""
    from stalwart.commands.chaos import resolve_target
    from stalwart.launch.client import ADDRESS_FILE, MasterClient, MasterError

    if args.master or (args.run_dir is not None and (args.run_dir / ADDRESS_FILE).exists()):
        try:
            address, token = resolve_target(args.run_dir, args.master, args.job_token)
            return MasterClient(address, token, timeout_s=3.0, retry_for_s=0.0).status(), True
        except (OSError, MasterError) as err:
            if args.master:
                raise ValueError(f"master at {args.master} unreachable or refused: {err}") from None
    journal_path = args.run_dir / "journal.sqlite" if args.run_dir is not None else None
    if journal_path is None or not journal_path.exists():
        return None, False
    from stalwart.launch.journal import Journal

    journal = Journal(journal_path)
    try:
        status = {
            "job_id": journal.get("job_id"),
            "restarts_used": journal.get("restarts_used", 0),
            "restart_budget": journal.get("restart_budget"),
            "nodes": journal.nodes(),
            "incidents": journal.incidents(),
        }
    finally:
        journal.close()
    return status, False


def _summary(roots: list[Path]) -> dict[str, Any] | None:
    for root in roots:
        for path in sorted({*root.glob("summary.json"), *root.glob("**/summary.json")}):
            try:
                return json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
    return None


def run(args: argparse.Namespace, *_: Any) -> int:
    from stalwart.observe.jobstatus import build_status
    from stalwart.observe.records import read_meta, read_records

    if args.run_dir is None and args.master is None:
        raise ValueError("name the job: stalwart status RUN_DIR, or --master URL --job-token TOKEN")
    if args.run_dir is not None and not args.run_dir.is_dir():
        raise ValueError(f"{args.run_dir} is not a directory; pass the run directory of a job")
    roots = [p for p in (args.run_dir, args.records) if p is not None]
    master, live = _master_status(args)
    records = [r for root in roots for r in read_records(root)]
    if master is None and not records:
        raise ValueError(f"nothing to report under {args.run_dir}: no journal.sqlite, no master, no rank records")
    # pipeline stages do different work by design: a rank's straggler peers are those of its stage
    stages = {rank: (m.get("coords") or {}).get("pp", 0) for root in roots for rank, m in read_meta(root).items()}
    status = build_status(master, live, records, _summary(roots), args.incidents, stages)
    if args.json:
        print(json.dumps(status, default=str))
    else:
        render(status)
    return 0


def render(status: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console()
    tps, mfu = status.get("tokens_per_s"), status.get("mfu")
    head = f"[bold]{status['state']}[/bold] · step {status.get('step')}"
    head += f" · {tps:,.0f} tok/s" if tps else ""
    head += f" · MFU {mfu:.1%}" if mfu is not None else ""
    if status.get("restarts_used") is not None:
        head += f" · restarts {status['restarts_used']}/{status.get('restart_budget')}"
    console.print(head)
    for n in status.get("nodes", []):
        flag = " (straggler)" if n["node"] in status.get("stragglers", []) else ""
        console.print(
            f"  node {n['node']} {n['state']}{flag} · workers {n['workers']} · step {n['step']} · "
            f"heartbeat {n['heartbeat_age_s']} s ago"
        )
    for inc in status.get("incidents", []):
        detect = f"detected in {inc['detect_s']:.1f} s" if inc["detect_s"] is not None else ""
        recover = f"recovered in {inc['recover_s']:.1f} s" if inc["recover_s"] is not None else "not recovered"
        console.print(f"  incident {inc['id']} {inc['kind']} (node {inc['node']}): {detect}, {recover}")
    for rank, sections in (status.get("section_stragglers") or {}).items():
        why = "≥ 1.2 × its peers for 2 windows of 10 steps"
        console.print(f"  straggler: rank {rank} slow in {', '.join(sections)} ({why})")
    if scale := status.get("autoscale"):
        guess = " (extrapolated)" if scale["best"] in scale.get("extrapolated", []) else ""
        console.print(
            f"  autoscale ({scale['mode']}): {scale['best']} nodes recommended{guess}, now {scale['current']}; "
            f"predicted throughput {scale['gain']:+.0%}"
        )
    if status.get("checkpoint"):
        console.print(f"  checkpoint: {status['checkpoint']}")
    if status.get("diagnosis"):
        console.print(f"[bold]hang diagnosis[/bold]\n{status['diagnosis']}")

"""`stalwart demo`: the main job of `make demo` — a 2-node job that survives injected faults.

Thin on purpose: the orchestration lives in `stalwart.demo`, the figures' definitions in
`stalwart.demo.recovery_metrics`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    from stalwart.chaos.faults import ACTIONS

    p = sub.add_parser(
        "demo",
        help="run the fault-tolerance demo (2 local nodes, injected kill/exception/hang)",
        description='Start a job master and two `stalwart run` agents ("nodes", one worker each) on this '
        "host, train the debug model with flash checkpoints, and inject a SIGKILL, an exception and "
        "a hang on rank 1 at 1/4, 1/2 and 3/4 of the steps. Incidents print as the master journals "
        "them. The report gives, per incident, detection time, MTTR (fault → next completed step), "
        "regain (fault → back past the step before the fault) and lost steps; goodput (productive "
        "step time of the final trajectory ÷ wall time); checkpoint stall; and whether "
        "the final weights are bitwise equal to a fault-free run (run once, cached in "
        "OUT_DIR/reference.json).",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=Path("runs/demo"),
        help="journal, logs, metrics and the reference cache (default runs/demo)",
    )
    p.add_argument(
        "--faults",
        default="kill,exception,hang",
        help=f"comma-separated actions to inject on rank 1, spaced evenly over the run, from "
        f"{', '.join(ACTIONS)} (default kill,exception,hang)",
    )
    p.add_argument("--no-faults", action="store_true", help="run the job without faults")
    p.add_argument("--no-reference", action="store_true", help="skip the fault-free comparison run")
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=10.0,
        help="seconds of silence before a rank is declared hung (default 10)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--json-report", type=Path, default=None, help="also write the report to this file as JSON")
    p.set_defaults(handler=run)


def _faults(text: str, no_faults: bool) -> tuple[str, ...]:
    from stalwart.chaos.faults import ACTIONS, NUMERIC

    if no_faults:
        return ()
    actions = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in actions if a not in ACTIONS or a in NUMERIC or a in ("delay", "slow")]
    if bad:
        raise ValueError(
            f"--faults: {', '.join(bad)} cannot be injected by the demo; use kill, segv, exit, exception, hang or stop"
        )
    return actions


def run(args: argparse.Namespace, *_: Any) -> int:
    from rich.console import Console

    from stalwart.demo.job import DemoOptions
    from stalwart.demo.run import run_demo

    opts = DemoOptions(
        steps=args.steps,
        out_dir=args.out_dir,
        faults=_faults(args.faults, args.no_faults),
        hang_timeout_s=args.hang_timeout,
        reference=not args.no_reference,
    )
    console = Console(stderr=args.json, soft_wrap=True)
    result, ok = run_demo(opts, console)
    if args.json_report:
        args.json_report.parent.mkdir(parents=True, exist_ok=True)
        args.json_report.write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
    else:
        _print_report(console, result)
    return 0 if ok else 1


def _print_report(console: Any, result: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="incidents")
    for column in ("injected", "at step", "detected as", "detected (s)", "MTTR (s)", "regain (s)", "lost steps"):
        table.add_column(column)
    for inc in result["incidents"]:
        table.add_row(
            *(
                str(v) if v is not None else "-"
                for v in (
                    inc["injected"],
                    inc["at_step"],
                    f"{inc['kind']} ({inc['class']})",
                    inc["detected_s"],
                    inc["mttr_s"],
                    inc["regain_s"],
                    inc["lost_steps"],
                )
            )
        )
    console.print(table)
    equal = {True: "[bold green]yes[/]", False: "[bold red]NO[/]", None: "not compared"}[result["bitwise_equal"]]
    console.print(
        f"steps {result['steps']} · wall {result['wall_s']:.1f} s · restarts {result['restarts_used']} · "
        f"goodput {result['goodput']:.1%} · checkpoint stall {result['stall_s']:.2f} s"
    )
    console.print(
        f"final weights bitwise equal to the fault-free reference"
        f"{' (cached)' if result['reference_cached'] else ''}: {equal}"
    )
    console.print(f"final {result['final_hash']}\nref   {result['reference_hash']}")
    if result["bitwise_equal"] is False:
        print("stalwart demo: the recovered weights differ from the reference", file=sys.stderr)

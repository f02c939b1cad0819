"""`stalwart run`: torchrun-compatible launcher that keeps jobs training through failures.

Registered with a pass-through argument list so `stalwart --help` does not import torch; the full
parser (torchrun's flags plus ours) is built when the command runs, and answers `--help` itself.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="torchrun-compatible launcher with fault detection and recovery",
        add_help=False,
        description="See `stalwart run --help`.",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, *_: Any) -> int:
    from stalwart import runtime
    from stalwart.launch.run import run as launch

    # The agent's work is done (summary written, keeper and zygote stopped): no interpreter finalization
    # with torch loaded, ~0.7 CPU-s per agent — and seconds a preempted allocation does not have.
    runtime.exit_process(launch(args.argv))

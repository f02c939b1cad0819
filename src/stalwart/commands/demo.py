"""`stalwart demo`: the main job of `make demo`.

For now: prepare the stdlib corpus on first use, train the debug model for a few hundred steps on 2
local processes (DDP over gloo) and print a summary. The fault-tolerant demo replaces this once
`stalwart run` exists.
"""

from __future__ import annotations

import argparse
from typing import Any

from stalwart.commands.common import emit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the demo job (debug model, 2 local processes)",
                       description="Prepare the built-in corpus (first run only), train the debug model "
                                   "on local worker processes and print a summary.")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--nproc", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--dp-mode", default="ddp", choices=("ddp", "fsdp"), help="data parallelism (default ddp)")
    p.add_argument("--out-dir", default="runs/demo", help="where metrics and summary go (default runs/demo)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, *_: Any) -> int:
    from stalwart.commands.train import train

    overrides = {"train.steps": str(args.steps), "train.out_dir": args.out_dir,
                 "parallel.dp_mode": args.dp_mode}
    worker_argv = [f"--{k}={v}" for k, v in overrides.items()]
    summary = train(None, overrides, args.nproc, worker_argv)
    assert summary is not None
    emit(summary, args.json, f"demo: debug model, {args.nproc} processes, {args.dp_mode}")
    return 0

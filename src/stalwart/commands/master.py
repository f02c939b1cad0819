"""`stalwart master`: run a job master by itself (multi-node jobs; single-host jobs start one)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from stalwart.launch import autoscale, eviction, stragglers
from stalwart.runtime import ENV_JOB_TOKEN, worker_env


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "master",
        help="run the job master (HTTP+JSON API, SQLite journal)",
        description="Serve the job master: membership, heartbeats, incidents and decisions, journaled "
        "in SQLite so a restarted master resumes the job. Every call needs the job token "
        "(Authorization: Bearer TOKEN). Binds to loopback unless --host says otherwise.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=29600, help="TCP port, 0 = any free port (default 29600)")
    p.add_argument(
        "--db",
        type=Path,
        default=Path("runs/master/journal.sqlite"),
        help="SQLite journal; reuse it to resume after a master restart",
    )
    p.add_argument("--job-id", default="job", help="job name recorded in the journal (default job)")
    p.add_argument(
        "--job-token",
        default=None,
        help=f"job token (default: ${ENV_JOB_TOKEN}, else read from or created in DB_DIR/token with mode 0600)",
    )
    p.add_argument("--restart-budget", type=int, default=3, help="restarts allowed for the whole job (default 3)")
    p.add_argument(
        "--node-timeout",
        type=float,
        default=30.0,
        help="seconds without a heartbeat before a node is declared lost (default 30)",
    )
    p.add_argument(
        "--rdzv-port",
        type=int,
        default=None,
        help="also serve the agents' c10d rendezvous store on this port (0 = any free port), so "
        "the job survives the loss of any node; `stalwart run --master URL --rdzv-backend c10d` "
        "without --rdzv-endpoint then uses it (default: off, an agent serves it as in torchrun)",
    )
    stragglers.add_arguments(p)
    eviction.add_arguments(p)
    autoscale.add_arguments(p)
    p.add_argument(
        "--ready-file", type=Path, help="write {address, pid} here as JSON once listening (for scripts and tests)"
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, *_: Any) -> int:
    from stalwart.launch.master import Master, load_or_create_token

    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"stalwart master: listening on {args.host}, beyond loopback; the job token is the only guard",
            file=sys.stderr,
        )
    if args.restart_budget < 0:
        raise ValueError(f"--restart-budget must be ≥ 0, got {args.restart_budget}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    token = load_or_create_token(args.db.parent / "token", args.job_token or worker_env().job_token or None)
    master = Master(
        args.db,
        token,
        args.host,
        args.port,
        args.job_id,
        args.restart_budget,
        args.node_timeout,
        stragglers.from_args(args),
        rdzv_port=args.rdzv_port,
        policy=eviction.from_args(args),
        autoscaler=autoscale.from_args(args),
    )
    master.start()
    if args.ready_file:
        tmp = args.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"address": master.address, "pid": os.getpid()}))
        os.replace(tmp, args.ready_file)
    store = f"; rendezvous store at {master.state.rdzv_endpoint}" if master.state.rdzv_endpoint else ""
    print(
        f"stalwart master for job {master.state.job_id!r} at {master.address} (journal {args.db}){store}",
        file=sys.stderr,
        flush=True,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    master.stop()
    return 0

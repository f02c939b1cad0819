"""`stalwart check`: matmul burn-in and paired collective tests that name a bad or slow node."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from stalwart.runtime import ENV_CHECK_FAULT, ENV_CHECK_SERIAL, ENV_PARENT_REPORTS, ENV_RANKS_PER_NODE, worker_env


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="health-check nodes: matmul burn-in + paired collectives, names bad/slow nodes",
        description="Run a matmul burn-in (compared with a float64 reference from the same seed) on "
        "every worker, then all-reduce tests in pairs of nodes: round 1 pairs neighbours, "
        "round 2 pairs each suspect with a healthy node, so a single bad node is isolated. "
        "Locally, --nodes N simulates N nodes as N blocks of local processes; under torchrun "
        "or `stalwart run` it checks the launcher's world (one node = LOCAL_WORLD_SIZE ranks).",
    )
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes when run without a launcher (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks per simulated node (default 1)")
    p.add_argument("--matmul-size", type=int, default=512, help="square matrix size for the burn-in (default 512)")
    p.add_argument("--iters", type=int, default=24, help="burn-in repetitions; the fastest counts (default 24)")
    p.add_argument("--collective-mb", type=float, default=1.0, help="all-reduce payload in MiB (default 1)")
    p.add_argument(
        "--slow-factor",
        type=float,
        default=2.0,
        help="burn-in: a node slower than this × the median node is a straggler (default 2.0; "
        "one-shot timings vary by 1.4× on a shared host)",
    )
    p.add_argument(
        "--fault",
        default=None,
        help="inject a fault for tests: node-fail:node=N | slow:node=N[:factor=F] | nan:node=N "
        f"(default ${ENV_CHECK_FAULT})",
    )
    p.add_argument("--out", type=Path, help="write the JSON report here (rank 0)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(handler=run)


def _worker(args: argparse.Namespace, cfg) -> dict[str, Any] | None:
    import torch

    from stalwart.dist import init_distributed, shutdown
    from stalwart.health.check import run_check, summarize

    env = init_distributed()
    torch.set_num_threads(1)
    ranks_per_node = worker_env().ranks_per_node or env.local_world_size
    try:
        report = summarize(run_check(cfg, ranks_per_node, env.device))
    finally:
        shutdown()
    if env.rank != 0:
        return None
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


def run(args: argparse.Namespace, *_: Any) -> int:
    from stalwart.dist import launched
    from stalwart.health.check import CheckConfig, Fault

    contract = worker_env()
    fault = args.fault or contract.check_fault or None
    cfg = CheckConfig(
        matmul_size=args.matmul_size,
        iters=args.iters,
        collective_elems=max(1, int(args.collective_mb * (1 << 20) / 4)),
        slow_factor=args.slow_factor,
        fault=Fault.parse(fault),
        serial=contract.check_serial,
    )
    if launched():
        report = _worker(args, cfg)
        if contract.parent_reports:  # spawned by a local parent, which prints the report
            return 0
    else:
        if args.nodes < 2 or args.nproc_per_node < 1:
            raise ValueError("need --nodes ≥ 2 and --nproc-per-node ≥ 1 for a paired check")
        from stalwart.launch.local import spawn_local

        out = args.out or Path(tempfile.mkdtemp(prefix="stalwart-check-")) / "report.json"
        spawn_local(
            args.nodes * args.nproc_per_node,
            [
                "check",
                "--matmul-size",
                str(args.matmul_size),
                "--iters",
                str(args.iters),
                "--collective-mb",
                str(args.collective_mb),
                "--slow-factor",
                str(args.slow_factor),
                "--out",
                str(out),
                *(["--fault", fault] if fault else []),
            ],
            env={ENV_RANKS_PER_NODE: str(args.nproc_per_node), ENV_PARENT_REPORTS: "1", ENV_CHECK_SERIAL: "1"},
        )
        report = json.loads(out.read_text())
    if report is None:
        return 0
    if args.json:
        print(json.dumps(report))
    else:
        _table(report)
    return 0 if report["ok"] else 1


def _table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="stalwart check")
    for col in ("node", "verdict", "matmul ms", "round 1 pair", "round 1 ms", "round 2 pair", "round 2 ms", "why"):
        table.add_column(col)
    for n in report["nodes"]:
        verdict = "[red]FAIL" if not n["ok"] else "[yellow]SLOW" if n["straggler"] else "[green]ok"
        table.add_row(
            str(n["node"]),
            verdict,
            f"{n['matmul_s'] * 1e3:.2f}",
            str(n["round1_pair"] or "-"),
            f"{n['round1_s'] * 1e3:.2f}",
            str(n["round2_pair"] or "-"),
            f"{n['round2_s'] * 1e3:.2f}" if n["round2_s"] is not None else "-",
            "; ".join(n["reasons"]),
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(table)

"""`stalwart plan simulate`: a discrete-event simulation of one long job's ETTR under failures
(:mod:`stalwart.plan.simulate`). Without ``--gpus`` it runs the study (published figures reproduced,
stalwart vs checkpoint-restart from 1k to 100k GPUs); with ``--gpus`` one job, every policy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulate (`stalwart plan simulate`)")
    g.add_argument(
        "--failures", default="llama3", help="failure rates: llama3 (Llama 3 405B, default) or meta-rsc (Meta 2024)"
    )
    g.add_argument("--sim-days", type=float, default=30.0, help="wall-clock days simulated per run (default 30)")
    g.add_argument("--runs", type=int, default=20, help="independent runs per point (default 20)")
    g.add_argument("--seed", type=int, default=0, help="random seed: same seed, same answer (default 0)")
    g.add_argument("--spares", type=int, help="spare nodes (default: a spare is always there)")
    g.add_argument("--repair-hours", type=float, default=24.0, help="a failed node returns after (default 24)")
    g.add_argument("--step-s", type=float, default=6.0, help="seconds per training step (default 6)")
    g.add_argument(
        "--comm-init-s", type=float, default=60.0, help="rendezvous + communicator setup per restart (default 60)"
    )
    g.add_argument("--plot", metavar="PNG", help="write ETTR vs GPUs per policy (needs matplotlib: stalwart[plot])")


def run_simulate(args: argparse.Namespace) -> int:
    from stalwart.plan import ettr_study, failures
    from stalwart.plan.simulate import Job, run

    pols = ettr_study.policies(args.step_s, args.comm_init_s)
    classes = failures.preset(args.failures)
    if args.gpus:
        job = Job(args.gpus, args.sim_days, args.gpus_per_node or 8, args.spares, args.repair_hours)
        result: dict[str, Any] = {
            "failures_preset": args.failures,
            "job": vars(job),
            "policies": {k: vars(p) for k, p in pols.items()},
            "results": [run(job, classes, p, args.runs, args.seed) for p in pols.values()],
        }
    else:
        result = ettr_study.study(args.runs, args.seed, pols=pols, classes=classes, days=args.sim_days)
    if args.plot:
        result["plot"] = plot(result, Path(args.plot))
    if args.json:
        print(json.dumps(result, default=str))
    else:
        _print(result)
    return 0


def _print(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rows = result.get("results") or result["sweep"]
    table = Table("policy", "GPUs", "ETTR", "p5–p95", "failures", "MTTF h", title="ETTR by policy")
    for r in rows:
        mttf = f"{r['mttf_hours']:.2f}" if r["mttf_hours"] else "-"
        spread = f"{r['ettr_p5']:.3f}–{r['ettr_p95']:.3f}"
        table.add_row(r["policy"], str(r["gpus"]), f"{r['ettr']:.3f}", spread, f"{r['failures']:.0f}", mttf)
    console.print(table)
    for key in ("llama3", "meta_rsc_mttf_hours", "byterobust", "analytic_check", "plot"):
        if key in result:
            console.print(f"[bold]{key}[/bold]: {json.dumps(result[key], default=str)}")


def plot(result: dict[str, Any], path: Path) -> str:
    """ETTR vs GPUs per policy (log x), with the published points; returns the path written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'stalwart[plot]'") from None
    rows = result.get("sweep") or result.get("results") or []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["gpus"], r["ettr"], r["ettr_p5"], r["ettr_p95"]) for r in rows if r["policy"] == name)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, marker="o", label=name)
        ax.fill_between(xs, [p[2] for p in pts], [p[3] for p in pts], alpha=0.15)
    ax.scatter([16384], [0.90], marker="^", color="k", zorder=5, label="Llama 3 405B: > 90 % (published)")
    ax.scatter([9600], [0.97], marker="s", color="tab:red", zorder=5, label="ByteRobust: 97 % (published)")
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (effective training time ratio)")
    ax.set_title("Simulated ETTR vs scale (Llama 3 failure rates)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)

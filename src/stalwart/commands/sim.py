"""`stalwart sim`: the cluster simulator — scheduling policies replayed over public traces.

Three sources, each with its published figure to compare against (pollux also runs `hypersched` and,
when named in --policies, the learned `mlfs`, trained first: `--episodes`, `--budget-s`, `--checkpoint`;
docs/sched.md):
  - ``elasticflow``: the ITP cluster traces of ElasticFlow (ASPLOS'23) with deadlines, on A100
    throughputs; deadline satisfaction ratio (DSR) per trace, as in their Fig. 8b.
  - ``pollux``: the 8 synthetic workloads of Pollux (OSDI'21) on 64 GPUs, with measured throughput
    and statistical efficiency; average JCT per workload, as in their Fig. 8a.
  - ``sharing``: GPU sharing between production and opportunistic jobs on both sources' traces
    (policies exclusive, gandiva, antman, muxflow, stalwart; interference from a fitted model):
    GPU utilisation, production slowdown within --bound, opportunistic JCT (``commands/sim_sharing.py``).
The simulators are ``stalwart.sched.elasticflow_sim`` and ``stalwart.sched.pollux_sim``; the data
they read ships with stalwart (``stalwart/sched/data/<source>``, with each source's licence and
PROVENANCE.md); ``--data`` points at another copy with the same layout."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

SOURCES = ("elasticflow", "pollux", "sharing")
LEARNED = ("hypersched", "mlfs")  # pollux only: the learned policy and its greedy baseline (sched/mlfs_*.py)
LAYOUT = {"elasticflow": ("traces", "throughputs_A100"), "pollux": ("traces", "workloads")}  # what --data holds


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim",
        help="replay scheduling policies over public cluster traces (ElasticFlow, Pollux)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source", choices=SOURCES, help="whose traces: elasticflow (deadlines), pollux (JCT) or sharing (GPU sharing)"
    )
    p.add_argument(
        "--traces",
        help="which traces, comma-separated: elasticflow cluster numbers 1-10 (default all), pollux "
        "workload numbers 1-8 (default all); sharing: names cluster01..cluster10, workload1..workload8",
    )
    p.add_argument(
        "--policies", help="comma-separated policies (default: every policy of the source but mlfs, which trains first)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed: same seed, same answer (default 0)")
    p.add_argument("--restart-cost", type=float, default=None, help="seconds each reallocation costs stalwart's policy")
    p.add_argument(
        "--data", type=Path, help="the source's data folder (default: the copy shipped in stalwart/sched/data/<source>)"
    )
    p.add_argument("--bound", type=float, default=0.1, help="sharing: a production job's allowed throughput loss")
    p.add_argument("--production-share", type=float, default=0.5, help="sharing: share of jobs marked production")
    p.add_argument("--max-jobs", type=int, help="sharing: only each trace's first N jobs")
    p.add_argument("--json", action="store_true", help="one JSON summary on stdout")
    p.add_argument("--plot", metavar="PNG", help="write a figure: DSR per trace or average JCT per workload")
    p.add_argument("--episodes", type=int, default=80, help="mlfs: training episodes (default 80)")
    p.add_argument("--budget-s", type=float, default=600.0, help="mlfs: stop training after this long (default 600)")
    p.add_argument("--checkpoint", type=Path, help="mlfs: resume training from / save it to this file")
    p.set_defaults(handler=run)


def _numbers(text: str | None, valid: range, what: str) -> list[int]:
    if not text:
        return list(valid)
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--traces takes comma-separated {what} numbers, got {text!r}") from None
    bad = [x for x in out if x not in valid]
    if bad or not out:
        raise ValueError(f"--traces: {what} numbers are {valid.start}-{valid.stop - 1}, got {bad or text!r}")
    return out


def _policies(text: str | None, known: tuple[str, ...]) -> list[str]:
    """The named policies, or every one but ``mlfs`` (it trains for minutes first: only when named)."""
    chosen = [p.strip() for p in text.split(",") if p.strip()] if text else [p for p in known if p != "mlfs"]
    unknown = [p for p in chosen if p not in known]
    if unknown or not chosen:
        raise ValueError(f"--policies: unknown {unknown or text!r}; choose from {', '.join(known)}")
    return chosen


def run(args: argparse.Namespace, *_: Any) -> int:
    if args.source == "sharing":
        from stalwart.commands.sim_sharing import run_sharing

        return run_sharing(args)
    if args.source == "elasticflow":
        from stalwart.sched import elasticflow_sim as sim

        traces: list[Any] = [f"cluster{n:02d}" for n in _numbers(args.traces, range(1, 11), "cluster")]
    else:
        from stalwart.sched import pollux_sim as sim  # type: ignore[no-redef]

        traces = _numbers(args.traces, range(1, 9), "workload")
    policies = _policies(args.policies, sim.POLICIES + (LEARNED if args.source == "pollux" else ()))
    kwargs: dict[str, Any] = {"seed": args.seed}
    if args.restart_cost is not None:
        kwargs["restart_cost_s"] = args.restart_cost
    if args.data is not None:
        if not args.data.is_dir():
            raise ValueError(f"--data {args.data} is not a directory")
        missing = [d for d in LAYOUT[args.source] if not (args.data / d).is_dir()]
        if missing:
            raise ValueError(
                f"--data {args.data} has no {', '.join(f'{d}/' for d in missing)} folder: it needs the layout of "
                f"the shipped {args.source} data ({', '.join(f'{d}/' for d in LAYOUT[args.source])})"
            )
        kwargs["data_root"] = args.data
    rows = []
    from rich.progress import Progress

    learned: dict[str, Any] = {}
    with Progress(console=_console(args.json), transient=True) as bar:
        if set(policies) & set(LEARNED):
            from stalwart.sched.mlfs_sim import prepare

            learned = prepare(args, policies, kwargs, bar)
        overall = bar.add_task("simulating", total=len(traces) * len(policies))
        for trace in traces:
            for policy in policies:
                task = bar.add_task(f"{trace} · {policy}", total=None)
                started = time.perf_counter()
                simulate = learned["simulate"] if policy in LEARNED else sim.simulate
                result = simulate(trace, policy, progress=_updater(bar, task), **kwargs)
                bar.remove_task(task)
                bar.advance(overall)
                rows.append({**result.summary(), "wall_s": round(time.perf_counter() - started, 3)})
    if args.plot:
        _plot(rows, args.source, Path(args.plot))
    if args.json:
        extra = {"mlfs_training": learned["report"]} if "report" in learned else {}
        print(json.dumps({"source": args.source, "results": rows, **extra}, default=float))
    else:
        _print_table(rows, args.source)
    return 0


def _updater(bar: Any, task: Any) -> Any:
    """The simulator's progress(done, total) callback, shown on one of the bar's lines."""
    return lambda done, total: bar.update(task, completed=done, total=total)


def _console(quiet: bool) -> Any:
    from rich.console import Console

    return Console(stderr=True, quiet=quiet or not sys.stderr.isatty())


def _print_table(rows: list[dict[str, Any]], source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"stalwart sim {source}")
    for col in ("trace", "policy", "jobs", "DSR", "avg JCT (h)", "p99 JCT (h)", "GPU-hours", "reallocations", "wall s"):
        table.add_column(col)
    for r in rows:
        hours = [f"{r[k] / 3600:.2f}" if r.get(k) is not None else "—" for k in ("avg_jct_s", "p99_jct_s")]
        dsr = f"{r['dsr']:.3f}" if r.get("dsr") is not None else "—"
        table.add_row(
            str(r["trace"]), r["policy"], str(r["jobs"]), dsr, *hours,
            f"{r['gpu_hours']:.0f}", str(r["reallocations"]), f"{r['wall_s']:.1f}",
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 140).print(table)


def _plot(rows: list[dict[str, Any]], source: str, path: Path) -> None:
    """Grouped bars per trace: DSR (elasticflow) or average JCT in hours (pollux), one bar per policy."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'stalwart[plot]'") from None
    traces = list(dict.fromkeys(str(r["trace"]) for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    metric, label = (
        ("dsr", "deadline satisfaction ratio") if source == "elasticflow" else ("avg_jct_s", "average JCT (h)")
    )
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(traces) * max(1, len(policies)) / 3), 4))
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        values = []
        for trace in traces:
            row = next((r for r in rows if str(r["trace"]) == trace and r["policy"] == policy), {})
            value = row.get(metric)
            values.append(0.0 if value is None else value / (3600 if metric == "avg_jct_s" else 1))
        ax.bar([t + i * width for t in range(len(traces))], values, width, label=policy)
    ax.set_xticks([t + width * (len(policies) - 1) / 2 for t in range(len(traces))], traces, rotation=30)
    ax.set_ylabel(label)
    ax.set_title(f"stalwart sim {source}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""`stalwart sim sharing`: the GPU-sharing simulator (``stalwart.sched.sharing_sim``) over ElasticFlow
traces and Pollux workloads — one row per trace × policy, a table, ``--json``, ``--plot``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_TRACES = "workload1,workload4"  # contended and seconds each; name others (or all 18) with --traces
COLUMNS = ("gpu_util", "work_per_gpu", "prod_slowdown_mean", "prod_slowdown_max", "prod_bound_ok")


def run_sharing(args: argparse.Namespace) -> int:
    from stalwart.sched.interference import default_model
    from stalwart.sched.sharing_policies import POLICIES
    from stalwart.sched.sharing_sim import simulate
    from stalwart.sched.sharing_trace import TRACE_NAMES

    traces = [t.strip() for t in (args.traces or DEFAULT_TRACES).split(",") if t.strip()]
    unknown = [t for t in traces if t not in TRACE_NAMES]
    if unknown or not traces:
        raise ValueError(f"--traces: unknown {unknown or args.traces!r}; sharing takes names {', '.join(TRACE_NAMES)}")
    from stalwart.commands.sim import _policies

    policies = _policies(args.policies, POLICIES)
    if args.data is not None:
        raise ValueError("--data is for elasticflow and pollux; sim sharing reads the shipped data")
    if args.max_jobs is not None and args.max_jobs < 2:
        raise ValueError(f"--max-jobs must be ≥ 2, got {args.max_jobs}")
    model = default_model(args.seed)
    rows = []
    for trace in traces:
        for policy in policies:
            started = time.perf_counter()
            result = simulate(
                trace, policy, seed=args.seed, production_share=args.production_share, bound=args.bound,
                restart_cost_s=30.0 if args.restart_cost is None else args.restart_cost, max_jobs=args.max_jobs,
                model=model,
            )  # fmt: skip
            rows.append({**result.summary(), "wall_s": round(time.perf_counter() - started, 3)})
    if args.plot:
        plot(rows, Path(args.plot))
    if args.json:
        print(json.dumps({"source": "sharing", "model": model.report, "results": rows}, default=float))
    else:
        _table(rows, model.report)
    return 0


def _table(rows: list[dict[str, Any]], report: dict[str, float]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"stalwart sim sharing (interference model held-out MAE {report['heldout_mae']:.3f})")
    heads = ("trace", "policy", "jobs", "GPU util", "work/GPU", "prod slowdown", "prod worst", "bound ok")
    for col in (*heads, "prod JCT (h)", "opp JCT (h)", "wall s"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            r["trace"], r["policy"], str(r["jobs"]), *(f"{r[k]:.3f}" for k in COLUMNS[:4]), str(r["prod_bound_ok"]),
            *(f"{r[k] / 3600:.2f}" if r.get(k) is not None else "—" for k in ("prod_avg_jct_s", "opp_avg_jct_s")),
            f"{r['wall_s']:.1f}",
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Three panels per trace, one bar per policy: GPU utilisation, production slowdown, opportunistic JCT."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'stalwart[plot]'") from None
    traces = list(dict.fromkeys(r["trace"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    panels = (("gpu_util", "GPU utilisation", 1), ("prod_slowdown_mean", "production slowdown", 1))
    panels += (("opp_avg_jct_s", "opportunistic JCT (h)", 3600),)
    fig, axes = plt.subplots(1, 3, figsize=(max(9, 1.5 * len(traces) * 3), 3.6))
    width = 0.8 / len(policies)
    for ax, (key, label, scale) in zip(axes, panels):
        for i, policy in enumerate(policies):
            values = []
            for trace in traces:
                row = next((r for r in rows if r["trace"] == trace and r["policy"] == policy), {})
                values.append((row.get(key) or 0.0) / scale)
            ax.bar([t + i * width for t in range(len(traces))], values, width, label=policy)
        ax.set_xticks([t + width * (len(policies) - 1) / 2 for t in range(len(traces))], traces, rotation=30)
        ax.set_title(label, fontsize="medium")
    axes[0].legend(fontsize="small")
    fig.suptitle("stalwart sim sharing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Claim: the throughput model refits in < 50 ms (issue 15: refit online every ~30 s in < 50 ms).

Fits the Pollux-style model (stalwart.sched.throughput) to a few hundred measured configurations of
each Pollux application (the shipped Pollux traces, ≤ 8 replicas), several times each, and prints
the median fit time against the 50 ms budget, plus the fit's error at 9–16 replicas.

    python benchmarks/throughput_fit.py [--repeats 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from stalwart.sched.throughput import fit
from stalwart.sched.traces import APPS, DEFAULT_TRACES, load_app

BUDGET_S = 0.050
TRACES = DEFAULT_TRACES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    fit(load_app(args.traces, APPS[0]))  # warm: scipy's import is not a refit
    rows = {}
    for app in APPS:
        samples = load_app(args.traces, app)
        train = [s for s in samples if s.replicas <= 8]
        test = [s for s in samples if 9 <= s.replicas <= 16]
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            model = fit(train)
            times.append(time.perf_counter() - t0)
        cols = (np.array(c) for c in zip(*[(s.nodes, s.replicas, s.local_bsz) for s in test]))
        measured = np.array([s.step_time for s in test])
        mape = float(np.mean(np.abs(model.step_time(*cols) - measured) / measured))
        median = statistics.median(times)
        rows[app] = {
            "points": len(train),
            "fit_ms": round(median * 1e3, 2),
            "budget_ratio": round(median / BUDGET_S, 3),
        }
        rows[app]["mape_9_16"] = round(mape, 4)
    if args.json:
        print(json.dumps({"budget_ms": BUDGET_S * 1e3, "repeats": args.repeats, "apps": rows}, indent=1))
        return
    for app, r in rows.items():
        print(
            f"{app:12s} {r['points']:4d} points  fit {r['fit_ms']:7.2f} ms (median of {args.repeats}) = "
            f"{r['budget_ratio']:.2f} × the 50 ms budget;  MAPE at 9–16 replicas {r['mape_9_16']:.1%}"
        )


if __name__ == "__main__":
    main()

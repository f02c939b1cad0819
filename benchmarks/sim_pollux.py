"""Claim: the Pollux simulator reproduces Pollux (OSDI'21) Fig. 8a at load 1.0 (issue 15, item 2).

Runs every policy over the artifact's workloads 1–8 (the shipped data, or --data) and prints, per workload
and on the mean, our average JCT against the published one (``results-jobload/<policy>-1.0``), the
ratio, whether the three published policies come out in the published order, stalwart's policy
against the Pollux-like one, and the wall time. Acceptance: each published policy's mean within
±15 %, the order matching on ≥ 7 of 8 workloads, stalwart ≤ 1.05 × pollux on the mean.

    python benchmarks/sim_pollux.py [--workloads 1,2] [--policies pollux,tiresias] [--procs 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from stalwart.sched.pollux_sim import POLICIES, simulate
from stalwart.sched.pollux_workload import DEFAULT_ROOT as DATA

PUBLISHED = ("pollux", "optimus", "tiresias")
TOLERANCE = 0.15


def run(args: tuple[int, str, Path, float]) -> tuple[int, str, float, float, int]:
    workload, policy, root, restart = args
    t0 = time.perf_counter()
    result = simulate(workload, policy, data_root=root, restart_cost_s=restart)
    summary = result.summary()
    return workload, policy, summary["avg_jct_s"], time.perf_counter() - t0, summary["reallocations"]


def published(root: Path) -> dict[str, dict[int, float]]:
    out = {}
    for policy in PUBLISHED:
        path = root / "results-jobload" / f"{policy}-1.0" / "summary.json"
        if path.exists():
            avgs = json.loads(path.read_text())["avgs"]
            out[policy] = {int(k.split("-")[-1]): float(v) for k, v in avgs.items()}
    return out


def order(values: dict[str, float]) -> tuple[str, ...]:
    return tuple(sorted(values, key=values.__getitem__))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--restart-cost", type=float, default=30.0, help="seconds lost per (re)start")
    parser.add_argument("--procs", type=int, default=1, help="parallel processes (wall times stay per run)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workloads = [int(w) for w in args.workloads.split(",")]
    policies = args.policies.split(",")
    tasks = [(w, p, args.data, args.restart_cost) for w in workloads for p in policies]
    with ProcessPoolExecutor(max(1, args.procs)) as pool:
        results = list(pool.map(run, tasks))
    pub = published(args.data)
    ours = {(w, p): (jct, wall, realloc) for w, p, jct, wall, realloc in results}
    rows = []
    for w in workloads:
        row: dict[str, object] = {"workload": w}
        for p in policies:
            jct, wall, realloc = ours[w, p]
            ref = pub.get(p, {}).get(w)
            row[p] = {"avg_jct_s": round(jct, 1), "published_s": ref, "ratio": ref and round(jct / ref, 3)}
            row[p] |= {"wall_s": round(wall, 2), "reallocations": realloc}
        shared = [p for p in PUBLISHED if p in policies and p in pub]
        if len(shared) > 1:
            row["order_ok"] = order({p: ours[w, p][0] for p in shared}) == order({p: pub[p][w] for p in shared})
        rows.append(row)
    mean = {}
    for p in policies:
        ours_mean = sum(ours[w, p][0] for w in workloads) / len(workloads)
        ref_mean = sum(pub[p][w] for w in workloads) / len(workloads) if p in pub else None
        mean[p] = {"avg_jct_s": round(ours_mean, 1), "published_s": ref_mean and round(ref_mean, 1)}
        mean[p] |= {
            "ratio": ref_mean and round(ours_mean / ref_mean, 3),
            "wall_s": round(sum(ours[w, p][1] for w in workloads), 1),
        }
    checks = {f"{p}_within_15pct": abs(mean[p]["ratio"] - 1) <= TOLERANCE for p in policies if mean[p]["ratio"]}
    if any("order_ok" in r for r in rows):
        checks["order_ok_workloads"] = sum(bool(r.get("order_ok")) for r in rows)
    if "stalwart" in policies and "pollux" in policies:
        checks["stalwart_over_pollux"] = round(mean["stalwart"]["avg_jct_s"] / mean["pollux"]["avg_jct_s"], 3)
    report = {"restart_cost_s": args.restart_cost, "rows": rows, "mean": mean, "checks": checks}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    head = "".join(f" | {p + ' (ours/pub h, ratio, s)':34s}" for p in policies)
    print(f"{'workload':9s}{head} | order")
    for r in [*rows, {"workload": "mean", **mean}]:
        cells = ""
        for p in policies:
            c = r[p]  # type: ignore[index]
            pub_h = f"{c['published_s'] / 3600:.2f}" if c["published_s"] else "  - "
            ratio = f"{c['ratio']:.3f}" if c["ratio"] else "  -  "
            cells += f" | {c['avg_jct_s'] / 3600:5.2f} / {pub_h} h  {ratio}  {c['wall_s']:6.1f} s    "
        print(f"{r['workload']!s:9s}{cells} | {r.get('order_ok', '')}")
    print("checks:", json.dumps(checks))


if __name__ == "__main__":
    main()

"""Claim: a policy network trained in the simulator (``mlfs``, after MLFS: −64 % JCT vs HyperSched) beats
its greedy baseline (``hypersched``) on Pollux workloads it was not trained on (issue 29, item 2).

Per seed: train ``mlfs`` on windows of workloads 1–4 (``mlfs_train``), evaluate it on whole workloads
5–8 (other generator seeds: unseen). Beside it, in the same run: ``hypersched`` and the simulator's
existing policies on the same workloads. Prints per workload the average JCT of each policy (mlfs: the
median over seeds), mlfs / hypersched, where mlfs wins and loses (per workload, per application), the
learning curves and the cost of exploration (job-hours and GPU-hours the learning episodes spent beyond
the greedy policy on the same jobs).

    python benchmarks/sim_learned.py [--seeds 0,1,2] [--episodes 24] [--eval 5,6,7,8] [--procs 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from stalwart.sched import mlfs_sim, pollux_sim
from stalwart.sched.mlfs_train import TrainConfig, plot_curve, train

PUBLISHED = {"mlfs_vs_hypersched_jct": 1 - 0.64}  # MLFS (Wang et al.), avg JCT relative to HyperSched


def _per_app(result: Any) -> dict[str, float]:
    """Average JCT (s) per application (the job name's prefix)."""
    by: dict[str, list[float]] = {}
    for job in result.jobs:
        by.setdefault(job.name.rsplit("-", 1)[0], []).append(job.jct)
    return {app: sum(v) / len(v) for app, v in sorted(by.items())}


def learned(task: tuple[int, int, float, tuple[int, ...]]) -> dict[str, Any]:
    """Train one seed, evaluate it on every held-out workload."""
    seed, episodes, budget, workloads = task
    t0 = time.perf_counter()
    result = train(TrainConfig(seed=seed, episodes=episodes), budget_s=budget)
    evals = {}
    for w in workloads:
        sim = mlfs_sim.simulate(w, "mlfs", net=result.net, seed=seed)
        evals[w] = {**sim.summary(), "per_app": _per_app(sim)}
    return {"seed": seed, "training": result.report(), "eval": evals, "wall_s": time.perf_counter() - t0}


def baseline(task: tuple[int, str]) -> tuple[int, str, dict[str, Any]]:
    workload, policy = task
    t0 = time.perf_counter()
    if policy in mlfs_sim.POLICIES:
        sim = mlfs_sim.simulate(workload, policy)
    else:
        sim = pollux_sim.simulate(workload, policy)
    return workload, policy, {**sim.summary(), "per_app": _per_app(sim), "wall_s": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--episodes", type=int, default=24)
    parser.add_argument("--budget-s", type=float, default=900.0, help="training time cap per seed")
    parser.add_argument("--eval", default="5,6,7,8", help="held-out Pollux workloads")
    parser.add_argument("--baselines", default="hypersched,pollux,optimus,tiresias")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--plot", metavar="PNG", help="the learning curve of the first seed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    workloads = tuple(int(w) for w in args.eval.split(","))
    if set(workloads) & set(TrainConfig().train_workloads):
        raise ValueError(f"--eval {args.eval} overlaps the training workloads {TrainConfig().train_workloads}")
    policies = args.baselines.split(",")
    with ProcessPoolExecutor(max(1, args.procs)) as pool:
        runs_f = [pool.submit(learned, (s, args.episodes, args.budget_s, workloads)) for s in seeds]
        base = list(pool.map(baseline, [(w, p) for w in workloads for p in policies]))
        runs = [f.result() for f in runs_f]
    ours = {(w, p): row for w, p, row in base}
    rows, wins = [], 0
    for w in workloads:
        mlfs = [r["eval"][w]["avg_jct_s"] for r in runs]
        row: dict[str, Any] = {"workload": w, "mlfs_median_s": round(statistics.median(mlfs), 1)}
        row["mlfs_per_seed_s"] = [round(x, 1) for x in mlfs]
        for p in policies:
            row[f"{p}_s"] = round(ours[w, p]["avg_jct_s"], 1)
        if "hypersched" in policies:
            hs = ours[w, "hypersched"]
            row["mlfs_over_hypersched"] = round(statistics.median(mlfs) / hs["avg_jct_s"], 3)
            wins += row["mlfs_over_hypersched"] < 1
            apps = runs[0]["eval"][w]["per_app"]
            row["per_app_ratio_seed0"] = {a: round(apps[a] / hs["per_app"][a], 3) for a in apps}
            row["gpu_hours"] = {"mlfs_median": round(statistics.median(r["eval"][w]["gpu_hours"] for r in runs), 1)}
            row["gpu_hours"]["hypersched"] = round(hs["gpu_hours"], 1)
        rows.append(row)
    mean = {p: round(statistics.mean(ours[w, p]["avg_jct_s"] for w in workloads), 1) for p in policies}
    mean["mlfs"] = round(statistics.mean(r["mlfs_median_s"] for r in rows), 1)
    summary = {
        "mean_avg_jct_s": mean,
        "mlfs_over_hypersched_mean": round(mean["mlfs"] / mean["hypersched"], 3) if "hypersched" in mean else None,
        "published_mlfs_over_hypersched": PUBLISHED["mlfs_vs_hypersched_jct"],
        "workloads_mlfs_beats_hypersched": f"{wins}/{len(workloads)}",
        "exploration_cost_per_seed": [r["training"]["exploration_cost"] for r in runs],
        "training_wall_s_per_seed": [round(r["training"]["wall_s"], 1) for r in runs],
        "episodes_per_seed": [r["training"]["episodes"] for r in runs],
    }
    curves = {r["seed"]: [(c["episode"], c["ratio"]) for c in r["training"]["curve"]] for r in runs}
    if args.plot:
        plot_curve(runs[0]["training"]["curve"], Path(args.plot))
    out = {"train": "windows of 40 jobs of workloads 1-4", "eval": list(workloads), "rows": rows, "summary": summary}
    if args.json:
        print(json.dumps(out | {"curves": curves}))
    else:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

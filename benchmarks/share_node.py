"""A production job's step time beside an opportunistic job, free and under `stalwart run --share-with`.

Three set-ups, run back to back per repetition (paired, so slow drifts of the shared box cancel):
``alone`` (the production job only), ``free`` (a guest beside it under plain `stalwart run`) and
``governed`` (the same guest with ``--share-with`` and ``--share-bound``). Both jobs run the exact-integer
CPU steps of tests/e2e/scripts/busy_steps.py: 1 production worker, ``--guest-workers`` guest workers, on
this box's cores (CPU stand-in for a GPU's SMs). Reported: the production job's median step time while
the guest ran (ratio to alone: its slowdown) and the guest's steps per second (its share of the box).

    python benchmarks/share_node.py [--reps 3] [--seconds 10] [--bound 0.2] [--guest-workers 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "e2e" / "scripts" / "busy_steps.py"


def _job(run_dir: Path, out: Path, nproc: int, seconds: float, *run_args: str) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "stalwart", "run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["--run-dir", str(run_dir), *run_args, str(SCRIPT), "--out", str(out), "--steps", "1"]
    cmd += ["--size", "160", "--min-seconds", str(seconds)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _steps(out: Path, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (out / f"steps-rank{rank}.jsonl").read_text().splitlines()]


def one(setup: str, root: Path, args: argparse.Namespace) -> dict[str, float]:
    """The production job's median step time (and the guest's steps/s) while both trained."""
    prod_run = root / setup / "prod-run"
    prod_run.mkdir(parents=True)  # --share-with names it before the production job starts
    guest = None
    if setup != "alone":  # the guest first, training before the production job starts
        share = ("--share-with", str(prod_run), "--share-bound", str(args.bound)) if setup == "governed" else ()
        guest = _job(root / setup / "guest-run", root / setup / "guest", args.guest_workers, args.seconds + 30, *share)
        ready = [root / setup / "guest" / f"steps-rank{r}.jsonl" for r in range(args.guest_workers)]
        deadline = time.monotonic() + 120
        while not all(p.exists() and p.stat().st_size for p in ready):  # the guest trains: its start is over
            if guest.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{setup}: the guest did not start training (exit {guest.poll()})")
            time.sleep(0.1)
    prod = _job(prod_run, root / setup / "prod", 1, args.seconds)
    if prod.wait(timeout=args.seconds + 300) != 0:
        raise RuntimeError(f"{setup}: the production job failed (exit {prod.returncode})")
    if guest is not None:
        guest.kill()  # it would go on for its own seconds: only its time beside the production job counts
        guest.wait()
    steps = _steps(root / setup / "prod")
    start = steps[0]["t0"] + 1.0  # the first second warms up
    prod_s = [s["t1"] - s["t0"] for s in steps if s["t0"] >= start]
    row = {"prod_step_s": statistics.median(prod_s), "guest_steps_per_s": 0.0}
    if guest is not None:
        end = steps[-1]["t1"]
        beside = [
            s for r in range(args.guest_workers) for s in _steps(root / setup / "guest", r) if start <= s["t0"] < end
        ]
        row["guest_steps_per_s"] = len(beside) / (end - start)
    return row


def _ratios(rows: list[dict[str, float]], alone: list[float]) -> list[float]:
    return [r["prod_step_s"] / a for r, a in zip(rows, alone, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="the production job's training time per run")
    parser.add_argument("--bound", type=float, default=0.2)
    parser.add_argument("--guest-workers", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"alone": [], "free": [], "governed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for setup in runs:
                runs[setup].append(one(setup, Path(tmp) / str(rep), args))
                print(f"rep {rep} {setup}: {runs[setup][-1]}", file=sys.stderr, flush=True)
    alone = [r["prod_step_s"] for r in runs["alone"]]
    shared = {k: v for k, v in runs.items() if k != "alone"}
    result = {
        "bound": args.bound,
        "guest_workers": args.guest_workers,
        "cpus": len(os.sched_getaffinity(0)),
        "prod_step_s": {k: statistics.median(r["prod_step_s"] for r in v) for k, v in runs.items()},
        # paired: each repetition's ratio to its own alone run, then the median
        "prod_slowdown": {k: statistics.median(_ratios(v, alone)) for k, v in shared.items()},
        "guest_steps_per_s": {k: statistics.median(r["guest_steps_per_s"] for r in v) for k, v in shared.items()},
    }
    result["guest_share_kept"] = result["guest_steps_per_s"]["governed"] / result["guest_steps_per_s"]["free"]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        s, g = result["prod_slowdown"], result["guest_steps_per_s"]
        bound, kept = 1 + args.bound, result["guest_share_kept"]
        print(f"production slowdown: free guest {s['free']:.2f}x, governed {s['governed']:.2f}x (bound {bound:.2f}x)")
        print(f"guest steps/s: free {g['free']:.1f}, governed {g['governed']:.1f} ({kept:.0%} of free)")


if __name__ == "__main__":
    main()

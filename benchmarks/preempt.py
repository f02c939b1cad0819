"""How long from a preemption notice to the agent's exit, against the persist it must wait for?

    python benchmarks/preempt.py [--json] [--repeats 3] [--steps 40] [--at 12]

Runs `stalwart run --standalone --nproc-per-node 2 -m stalwart train` (debug model, flash checkpoints,
no periodic persist) and sends SIGUSR1 to the agent after ``--at`` steps. Per run, from the agent's
summary: signal → workers stopped, → the agreed step committed (the *persist*, the baseline: what a
preemption must wait for), → summary written; and from outside: signal → process gone (the *exit*).
Target (issue 18): exit ≤ persist + 2 s. Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def one_run(work: Path, data: Path, steps: int, at: int) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "stalwart", "run", "--standalone", "--nproc-per-node", "2",
        "--run-dir", str(work / "run"), "--summary-json", str(work / "run.json"),
        "-m", "stalwart", "train", "--config", str(REPO / "configs" / "debug.toml"), f"--data.dir={data}",
        "--data.seq_len=64", f"--train.steps={steps}", "--train.warmup_steps=2", f"--train.out_dir={work / 'out'}",
        "--checkpoint.enabled=true", f"--checkpoint.dir={work / 'ckpt'}", "--checkpoint.persist_every_steps=100000",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    metrics = work / "out" / "metrics.jsonl"
    while proc.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < at):
        time.sleep(0.05)
    if proc.poll() is not None:
        raise RuntimeError(f"the run ended before step {at}: {proc.stderr.read().decode()[-2000:]}")
    sent = time.time()
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=300)
    gone = time.time()
    if proc.returncode != 75:
        raise RuntimeError(f"exit {proc.returncode}, not 75: {err.decode()[-2000:]}")
    p = json.loads((work / "run.json").read_text())["preempted"]
    if not (work / "ckpt" / f"step-{p['save']['step']:08d}").is_dir():
        raise RuntimeError(f"step {p['save']['step']} was not committed: {p['save']}")
    return {
        "stopped_s": p["workers_stopped"] - sent,
        "persist_s": p["persisted_at"] - sent,
        "summary_s": p["exit"] - sent,
        "exit_s": gone - sent,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--at", type=int, default=12, help="send the notice after this many logged steps")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    from stalwart.data import ensure_default_corpus

    with tempfile.TemporaryDirectory() as tmp:
        data = ensure_default_corpus(Path(tmp) / "data")
        runs = [one_run(Path(tmp) / f"r{i}", data, args.steps, args.at) for i in range(args.repeats)]
    med = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    out: dict[str, Any] = {
        "benchmark": "preempt",
        "repeats": args.repeats,
        "median": med,
        "baseline_persist_s": med["persist_s"],
        "exit_minus_persist_s": round(med["exit_s"] - med["persist_s"], 3),
        "target_met": med["exit_s"] <= med["persist_s"] + 2.0,
        "runs": runs,
    }
    if args.json:
        print(json.dumps(out))
        return
    print("signal →   workers stopped   step committed   summary   process gone")
    for r in runs:
        print(
            f"          {r['stopped_s']:14.2f} s {r['persist_s']:14.2f} s {r['summary_s']:7.2f} s {r['exit_s']:12.2f} s"
        )
    m = med
    print(f"median    {m['stopped_s']:14.2f} s {m['persist_s']:14.2f} s {m['summary_s']:7.2f} s {m['exit_s']:12.2f} s")
    verdict = "met" if out["target_met"] else "NOT met"
    print(f"exit − persist = {out['exit_minus_persist_s']:.2f} s (target ≤ 2 s): {verdict}")


if __name__ == "__main__":
    main()

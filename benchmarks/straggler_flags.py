"""Claim (issue 14): a rank slowed 1.3× in forward is flagged within 20 steps, with no false flag in
200 clean steps.

Runs real 2-rank jobs (`stalwart train --nproc 2`, debug model, gloo) of STEPS steps: clean ones, and
ones whose rank 1 computes every forward 1.3× as long (chaos ``slow:at=forward:rank=1:factor=1.3``).
Their per-rank records are judged as the run went (every 5 steps) by ``observe.stragglers.scores``
as configured (``persist`` = 2 windows) and, as the baseline, on the same records with one window
(``persist=1``). Prints false flags per clean run, the first step at which the slow rank was
flagged, and the ratio of false flags baseline / configured.

    python benchmarks/straggler_flags.py [--runs 3] [--steps 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from stalwart.observe.records import read_records
from stalwart.observe.stragglers import scores

SLOW = "slow:at=forward:rank=1:factor=1.3"
EVERY = 5  # judged as the status page would, every few steps


def run(out: Path, data: Path, steps: int, chaos: str = "") -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "stalwart", "train", "--nproc", "2", "--config", "configs/debug.toml"]
    cmd += [f"--data.dir={data}", f"--train.steps={steps}", f"--train.out_dir={out}", "--train.log_every=1000"]
    env = dict(os.environ, STALWART_CHAOS=chaos, STALWART_CHAOS_DIR=str(out / "chaos"))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return list(read_records(out))


def judged(records: list[dict[str, Any]], steps: int, **kw: Any) -> list[tuple[int, dict]]:
    """(step, flagged) at every EVERY steps, on the records seen by then."""
    return [
        (end, scores([r for r in records if r["step"] <= end], **kw)["flagged"]) for end in range(10, steps + 1, EVERY)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="clean runs and slow runs each")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from stalwart.data import ensure_default_corpus

    result: dict[str, Any] = {"steps": args.steps, "runs": args.runs, "clean": [], "slow": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = ensure_default_corpus(Path(tmp) / "data")
        for i in range(args.runs):
            for kind, chaos in (("clean", ""), ("slow", SLOW)):
                records = run(Path(tmp) / f"{kind}{i}", data, args.steps, chaos)
                row = {}
                for name, kw in (("persist2", {}), ("persist1", {"persist": 1})):
                    flags = judged(records, args.steps, **kw)
                    if kind == "clean":
                        row[name] = sum(1 for _, f in flags if f)
                    else:
                        first = [end for end, f in flags if f.get(1) and "forward" in f[1]]
                        row[name] = {
                            "first_flag_step": first[0] if first else None,
                            "others_flagged": sum(1 for _, f in flags if set(f) - {1}),
                        }
                result[kind].append(row)
                if not args.json:
                    print(f"{kind} run {i + 1}: {row}", file=sys.stderr)
    clean2 = [r["persist2"] for r in result["clean"]]
    clean1 = [r["persist1"] for r in result["clean"]]
    firsts = [r["persist2"]["first_flag_step"] for r in result["slow"]]
    result["summary"] = {
        "evaluations_per_run": len(range(10, args.steps + 1, EVERY)),
        "false_flags_persist2": clean2,
        "false_flags_persist1_baseline": clean1,
        "baseline_over_configured": round(sum(clean1) / max(1, sum(clean2)), 2),
        "slow_first_flag_step": firsts,
        "slow_first_flag_step_median": statistics.median([f for f in firsts if f] or [0]),
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    s = result["summary"]
    print(
        f"false flags in {args.steps} clean steps ({s['evaluations_per_run']} evaluations per run): "
        f"{s['false_flags_persist2']} with 2 windows vs {s['false_flags_persist1_baseline']} with 1 "
        f"(baseline / configured = {s['baseline_over_configured']}); rank slowed 1.3× in forward first "
        f"flagged at steps {firsts} (median {s['slow_first_flag_step_median']})"
    )


if __name__ == "__main__":
    main()

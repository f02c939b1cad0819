"""Claim: observability costs no throughput — tokens/s with everything on ≥ 0.99 × everything off.

"Everything" = per-rank step records (sections, spans, loss, memory: one write per step per rank),
their ms histograms for /metrics (a file replaced every 2 s, carried by the agent's heartbeat), the
Flight Recorder dump thread (a stat twice a second) and the agent's reading of it all. Both sides run
the same job under `stalwart run --standalone` (2 ranks, gloo, the registry's ``debug`` model,
checkpoints off), in the same run, alternately, ``--repeats`` times each; "off" sets
``train.rank_records=false`` and ``train.flight_dumps=false``. tokens/s is the trainer's summary
figure (global batch × seq_len / median step time, process start excluded).

Reported: each side's median, their ratio, and the median of the per-repeat ratios (a repeat's two
runs go back to back in alternating order, so a drifting load on a shared box hits both alike).

    python benchmarks/observe_overhead.py --json
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

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "prepared" / "stdlib-byte"


def run_job(a: argparse.Namespace, tmp: Path, on: bool) -> float:
    out = tmp / "out"
    cmd = [sys.executable, "-m", "stalwart", "run", "--standalone", "--nproc-per-node", str(a.nproc)]
    cmd += ["--run-dir", str(tmp / "run"), "-m", "stalwart", "train", "--config", str(ROOT / "configs" / "debug.toml")]
    cmd += [f"--data.dir={a.data}", f"--data.seq_len={a.seq_len}", f"--train.steps={a.steps}"]
    cmd += [f"--train.global_batch={a.global_batch}", f"--train.micro_batch={a.micro_batch}", f"--train.out_dir={out}"]
    cmd += ["--checkpoint.enabled=false", "--guard.enabled=false"]
    cmd += [f"--train.rank_records={str(on).lower()}", f"--train.flight_dumps={str(on).lower()}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    if on != (out / "ranks" / "rank0.jsonl").exists():
        raise RuntimeError(f"observability {'on' if on else 'off'} but the rank records say otherwise")
    return float(json.loads((out / "summary.json").read_text())["tokens_per_s"])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--data", default=str(DATA))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from stalwart.data import ensure_default_corpus

    if Path(a.data) == DATA:
        ensure_default_corpus(DATA)
    on, off = [], []
    with tempfile.TemporaryDirectory(prefix="observe-overhead-") as tmp:
        for r in range(a.repeats):  # alternate which side goes first
            for side in (True, False) if r % 2 == 0 else (False, True):
                (on if side else off).append(run_job(a, Path(tmp) / f"{r}-{side}", side))
            if not a.json:
                print(f"repeat {r + 1}: on {on[-1]:,.0f} tok/s, off {off[-1]:,.0f} tok/s", file=sys.stderr)
    result = {
        "nproc": a.nproc,
        "steps": a.steps,
        "seq_len": a.seq_len,
        "global_batch": a.global_batch,
        "repeats": a.repeats,
        "on_tokens_per_s": statistics.median(on),
        "off_tokens_per_s": statistics.median(off),
        "on_runs": on,
        "off_runs": off,
        "ratio": statistics.median(on) / statistics.median(off),
        "paired_ratio_median": statistics.median(x / y for x, y in zip(on, off)),
        "target": 0.99,
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }
    if a.json:
        print(json.dumps(result))
    else:
        print(
            f"on {result['on_tokens_per_s']:,.0f} tok/s vs off {result['off_tokens_per_s']:,.0f} tok/s: ratio "
            f"{result['ratio']:.3f}, median of paired ratios {result['paired_ratio_median']:.3f} (target ≥ 0.99)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

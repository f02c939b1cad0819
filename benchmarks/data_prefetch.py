"""Claim: with ``data.prefetch`` the time to read a batch is hidden behind the step.

Reading is made slow on purpose: every batch read sleeps ``--delay`` seconds more (an injected delay in
``TokenDataset.rows``, as a slow file system or a remote store would). One process, the debug model,
three settings run alternately ``--repeats`` times in the same run:

* ``fast``: no delay, no prefetch (the baseline step);
* ``slow``: the delay, read in the step (``data.prefetch = 0``);
* ``slow+prefetch``: the delay, read ahead (``data.prefetch = --depth``).

Reported per setting: median step time and median "data" section (the step's wait for its batch, from
the rank records); ``hidden`` = 1 − (slow+prefetch − fast) / (slow − fast) on the step-time medians
(1: the read costs the step nothing, 0: prefetch hides none of it; None when the noise of a loaded
machine exceeds the delay), and ``data_wait_hidden`` = 1 − the data wait with prefetch / without.

    python benchmarks/data_prefetch.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "prepared" / "stdlib-byte"


def run(a: argparse.Namespace, env, out: Path, delay: float, prefetch: int) -> dict[str, float]:
    from stalwart.config import load_config
    from stalwart.data import TokenDataset
    from stalwart.train.trainer import Trainer

    cfg = load_config(
        ROOT / "configs" / "debug.toml",
        {
            "data.dir": a.data,
            "data.prefetch": prefetch,
            "data.seq_len": a.seq_len,
            "train.steps": a.steps,
            "train.warmup_steps": 0,
            "train.global_batch": a.global_batch,
            "train.micro_batch": a.micro_batch,
            "train.threads": 1,
            "train.tensorboard": "off",
            "train.out_dir": str(out),
        },
    )
    rows = TokenDataset.rows

    def slow_rows(self, indices):  # the injected delay: a slow read
        time.sleep(delay)
        return rows(self, indices)

    TokenDataset.rows = slow_rows
    try:
        summary = Trainer(cfg, env).fit(progress=False)
    finally:
        TokenDataset.rows = rows
    records = [json.loads(line) for line in (out / "ranks" / "rank0.jsonl").read_text().splitlines()]
    skip = 2  # the first steps allocate the optimizer state
    return {
        "step_s": statistics.median(r["ms"]["step"] / 1e3 for r in records[skip:]),
        "data_s": statistics.median(r["ms"]["data"] / 1e3 for r in records[skip:]),
        "tokens_per_s": summary["tokens_per_s"],
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--delay", type=float, default=0.05, help="seconds added to every batch read")
    p.add_argument("--depth", type=int, default=2, help="data.prefetch of the prefetch setting")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--data", default=str(DATA))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    from stalwart.data import ensure_default_corpus
    from stalwart.dist import init_distributed, shutdown

    if Path(a.data) == DATA:
        ensure_default_corpus(DATA)
    settings = {"fast": (0.0, 0), "slow": (a.delay, 0), "slow+prefetch": (a.delay, a.depth)}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in settings}
    env = init_distributed("gloo")
    try:
        with tempfile.TemporaryDirectory(prefix="data-prefetch-") as tmp:
            for r in range(a.repeats):
                order = list(settings) if r % 2 == 0 else list(reversed(settings))  # a drifting load hits all
                for name in order:
                    runs[name].append(run(a, env, Path(tmp) / f"{name}{r}", *settings[name]))
                    if not a.json:
                        print(f"repeat {r + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    finally:
        shutdown()
    med = {
        k: {m: statistics.median(x[m] for x in v) for m in ("step_s", "data_s", "tokens_per_s")}
        for k, v in runs.items()
    }
    fast, slow, pre = (med[k]["step_s"] for k in settings)
    result = {
        "delay_s": a.delay,
        "depth": a.depth,
        "steps": a.steps,
        "repeats": a.repeats,
        "medians": med,
        "runs": runs,
        "hidden": 1 - (pre - fast) / (slow - fast) if slow > fast else None,
        "prefetch_vs_fast_step_ratio": pre / fast,
        # the step's own wait for its batch (the "data" section): robust to a loaded box's step-time noise
        "data_wait_hidden": 1 - med["slow+prefetch"]["data_s"] / med["slow"]["data_s"],
        "machine": {"cpus": os.cpu_count(), "load_avg_1_5_15min": os.getloadavg()},  # a shared box's load
    }
    line = (
        f"step: fast {fast * 1e3:.1f} ms, slow {slow * 1e3:.1f} ms, slow+prefetch {pre * 1e3:.1f} ms; "
        f"data wait {med['slow']['data_s'] * 1e3:.1f} → {med['slow+prefetch']['data_s'] * 1e3:.1f} ms; "
        f"hidden {result['hidden']}"
    )
    print(json.dumps(result) if a.json else line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

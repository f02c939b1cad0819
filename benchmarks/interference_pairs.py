"""Measure pairwise interference: two jobs sharing one CPU core stand in for two kernels sharing a GPU's SMs.

This is a stand-in, not a GPU measurement: each "job" is a training-like loop of a small torch kernel on
one thread (a conv, an attention block, a GRU unrolled over time, an embedding-bag gather), optionally
idle for part of each step (the time a real job waits on input or the host, when a GPU would sit idle).
Both jobs are pinned to the same core, so the OS time-slices them and they share its caches and memory
bandwidth, as two kernels co-scheduled on the SMs share them and HBM. What transfers to GPUs is the shape
of the effect (busy jobs halve each other; jobs with idle time, or one memory-bound and one compute-bound,
interfere less), not the sizes.

The box is shared with other work, so every pair is measured *paired*: A alone, B alone, then A and B
together, back to back, repeated ``--reps`` times; the table keeps the median of the ratios
(throughput together / throughput alone), which cancels slow drifts in background load.

    python benchmarks/interference_pairs.py [--pairs 48] [--window 0.5] [--reps 3] [--seed 0] [--json]
        [--out src/stalwart/sched/data/interference/cpu_pairs.csv]

``--gavel simulation_throughputs.json --out gavel_v100_pairs.csv`` instead converts the published GPU pairs
of Gavel (OSDI'20; stanford-futuredata/gavel, scheduler/simulation_throughputs.json, MIT): every
single-GPU pair measured on a V100 with both jobs space-sharing it, as throughput together / alone.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

# Job kinds: family, batch, idle fraction (of each step, solo). Memory intensity is derived per family
# from the kernel's bytes moved per flop (``bytes_per_flop``), written into the table as a feature.
FAMILIES = ("conv", "transformer", "rnn", "embedding")
BATCHES = (4, 32)
IDLE = (0.0, 0.5)
KINDS = [(f, b, i) for f in FAMILIES for b in BATCHES for i in IDLE]
TAIL_S = 0.1  # each job runs on this long past its window, so the other's window is all shared


def _kernel(family: str, batch: int):
    """(step function, bytes per flop) of one family at one batch."""
    g = torch.Generator().manual_seed(0)
    if family == "conv":
        x, w = torch.randn(batch, 16, 16, 16, generator=g), torch.randn(16, 16, 3, 3, generator=g)
        flops, nbytes = 2 * batch * 16 * 16 * 9 * 16 * 16, 4 * 2 * x.numel()
        return (lambda: torch.nn.functional.conv2d(x, w, padding=1)), nbytes / flops
    if family == "transformer":
        x, w = torch.randn(batch, 32, 128, generator=g), torch.randn(128, 384, generator=g)

        def attn():
            q, k, v = (x @ w).chunk(3, dim=-1)
            return torch.softmax(q @ k.transpose(1, 2) / 11.3, dim=-1) @ v

        flops, nbytes = 2 * batch * 32 * 128 * 384 + 4 * batch * 32 * 32 * 128, 4 * (x.numel() * 4 + batch * 32 * 32)
        return attn, nbytes / flops
    if family == "rnn":
        cell, h = torch.nn.GRUCell(128, 128), torch.zeros(batch, 128)
        xs = torch.randn(8, batch, 128, generator=g)

        @torch.no_grad()
        def unroll():
            out = h
            for t in range(8):
                out = cell(xs[t], out)
            return out

        flops, nbytes = 8 * 2 * batch * 6 * 128 * 128, 8 * 4 * (6 * 128 * 128 + 4 * batch * 128)
        return unroll, nbytes / flops
    table = torch.randn(400_000, 64, generator=g)  # 100 MB: gathers miss the caches
    idx = torch.randint(0, 400_000, (batch * 256,), generator=g)
    offsets = torch.arange(0, batch * 256, 256)
    flops, nbytes = batch * 256 * 64, 4 * batch * 256 * 64
    return (lambda: torch.nn.functional.embedding_bag(idx, table, offsets, mode="sum")), nbytes / flops


def _worker(conn, core: int) -> None:
    """One job slot: pinned to ``core``, one torch thread; runs (kind, window, start time) requests."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    kernels = {}
    while (msg := conn.recv()) is not None:
        (family, batch, idle), window, start = msg
        if (family, batch) not in kernels:
            fn, bpf = _kernel(family, batch)
            fn()
            t0 = time.perf_counter()
            fn()
            repeat = max(1, round(0.004 / (time.perf_counter() - t0)))  # a step of at least ~4 ms
            t0 = time.perf_counter()
            for _ in range(3 * repeat):
                fn()
            kernels[family, batch] = (fn, bpf, repeat, (time.perf_counter() - t0) / 3)
        fn, bpf, repeat, solo_step = kernels[family, batch]
        sleep = solo_step * idle / (1 - idle) if idle else 0.0  # fixed host time per step, set from solo speed
        while time.time() < start:
            time.sleep(0.0005)
        t0 = time.perf_counter()
        steps, last = 0, t0
        while time.perf_counter() - t0 < window + TAIL_S:  # the tail keeps the partner loaded
            for _ in range(repeat):
                fn()
            if sleep:
                time.sleep(sleep)
            if (now := time.perf_counter()) - t0 <= window:
                steps, last = steps + 1, now
        conn.send((steps / (last - t0) if steps else 1 / (time.perf_counter() - t0), bpf))


def measure(pairs: list[tuple[tuple, tuple]], window: float, reps: int, core: int) -> list[dict]:
    ctx = mp.get_context("fork")
    ends = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_worker, args=(child, core), daemon=True) for _, child in ends]
    for p in procs:
        p.start()
    a_conn, b_conn = ends[0][0], ends[1][0]

    def run(a=None, b=None):
        start = time.time() + 0.05
        if a:
            a_conn.send((a, window, start))
        if b:
            b_conn.send((b, window, start))
        return (a_conn.recv() if a else None), (b_conn.recv() if b else None)

    rows = []
    for n, (a, b) in enumerate(pairs):
        run(a, None), run(None, b)  # warm both kernels (first call builds them)
        ra, rb = [], []
        for _ in range(reps):
            (solo_a, bpf_a), _ = run(a, None)
            _, (solo_b, bpf_b) = run(None, b)
            (pa, _), (pb, _) = run(a, b)
            ra.append(pa / solo_a)
            rb.append(pb / solo_b)
        row = {"a_" + k: v for k, v in zip(("family", "batch", "idle"), a)}
        row |= {"b_" + k: v for k, v in zip(("family", "batch", "idle"), b)}
        row |= {"a_bytes_per_flop": round(bpf_a, 5), "b_bytes_per_flop": round(bpf_b, 5)}
        row |= {"a_tput": round(statistics.median(ra), 4), "b_tput": round(statistics.median(rb), 4)}
        row |= {"a_spread": round(max(ra) - min(ra), 4), "b_spread": round(max(rb) - min(rb), 4)}
        rows.append(row)
        print(f"[{n + 1}/{len(pairs)}] {a} + {b}: {row['a_tput']:.3f} / {row['b_tput']:.3f}", flush=True)
    for conn, _ in ends:
        conn.send(None)
    for p in procs:
        p.join(5)
    return rows


GAVEL_FAMILY = {"ResNet-18": "conv", "ResNet-50": "conv", "Transformer": "transformer", "LM": "rnn"}
GAVEL_FAMILY["Recommendation"] = "embedding"  # A3C and CycleGAN have no batch size in Gavel's table: left out


def gavel_pairs(path: Path, gpu: str = "v100") -> list[dict]:
    """Gavel's published space-sharing throughputs as normalised pair rows (OOM pairs, marked 0, dropped)."""
    import ast
    import re

    table = json.loads(path.read_text())[gpu]

    def kind(key: str) -> tuple[str, int] | None:
        name, scale = ast.literal_eval(key)
        m = re.fullmatch(r"(.+) \(batch size (\d+)\)", name)
        return (GAVEL_FAMILY[m[1]] + ":" + m[1], int(m[2])) if m and scale == 1 and m[1] in GAVEL_FAMILY else None

    rows, seen = [], set()
    for a_key, entry in table.items():
        a = kind(a_key)
        for b_key, value in entry.items():
            b = kind(b_key) if b_key != "null" else None
            if a is None or b is None or (b_key, a_key) in seen or not value or min(value) <= 0:
                continue
            seen.add((a_key, b_key))
            solo_a, solo_b = entry["null"], table[b_key]["null"]
            fam_a, model_a = a[0].split(":")
            fam_b, model_b = b[0].split(":")
            rows.append(
                {"a_family": fam_a, "a_model": model_a, "a_batch": a[1], "b_family": fam_b, "b_model": model_b,
                 "b_batch": b[1], "a_tput": round(value[0] / solo_a, 4), "b_tput": round(value[1] / solo_b, 4)}
            )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=40, help="distinct pairs to measure, besides the self-pairs")
    parser.add_argument("--window", type=float, default=0.5, help="seconds per throughput window")
    parser.add_argument("--reps", type=int, default=3, help="paired repetitions per pair (median kept)")
    parser.add_argument("--core", type=int, default=0, help="the core both jobs share")
    parser.add_argument("--seed", type=int, default=0, help="which pairs are drawn")
    parser.add_argument("--out", type=Path, help="write the table here (CSV, with a provenance header)")
    parser.add_argument("--gavel", type=Path, help="convert Gavel's simulation_throughputs.json instead of measuring")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.gavel:
        rows = gavel_pairs(args.gavel)
        with open(args.out, "w", newline="") as f:
            f.write("# Gavel (OSDI'20) space-sharing pairs on one V100, normalised to solo throughput; converted by "
                    "benchmarks/interference_pairs.py --gavel from stanford-futuredata/gavel@c4fa400 "
                    "scheduler/simulation_throughputs.json (MIT licence)\n")  # fmt: skip
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        return
    others = list(itertools.combinations(KINDS, 2))
    random.Random(args.seed).shuffle(others)
    pairs = [(k, k) for k in KINDS] + others[: args.pairs]
    t0 = time.time()
    rows = measure(pairs, args.window, args.reps, args.core)
    meta = {
        "what": "CPU stand-in: two single-thread torch jobs pinned to one core (time-sliced, shared caches)",
        "host": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "window_s": args.window,
        "reps": args.reps,
        "seed": args.seed,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "load_avg_at_start": os.getloadavg()[0],
        "wall_s": round(time.time() - t0, 1),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", newline="") as f:
            f.write("# measured by benchmarks/interference_pairs.py: " + json.dumps(meta) + "\n")
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}))


if __name__ == "__main__":
    main()

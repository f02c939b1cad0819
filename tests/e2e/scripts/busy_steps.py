"""A CPU-bound job of exact integer steps for `stalwart run --share-with` (tests/e2e/test_share.py).

Each step multiplies a state matrix by a fixed one modulo a prime (int64: exact whatever the thread count
or the stops), reports the step, and logs its start and end time (steps-rank<r>.jsonl);
result-rank<r>.json holds the checksum after --steps."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

PRIME = 1_000_003


def chain(seed: int, size: int):
    """The step function and its initial state: state ← state @ weights mod PRIME."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randint(0, PRIME, (size, size), generator=g, dtype=torch.int64)
    state = torch.randint(0, PRIME, (size, size), generator=g, dtype=torch.int64)
    return (lambda s: (s @ weights) % PRIME), state


def checksum(state: torch.Tensor) -> int:
    return int(state.sum().item())


def main() -> None:
    from stalwart import report

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--min-seconds", type=float, default=0.0, help="go on stepping (after --steps) this long")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    step_fn, state = chain(args.seed, args.size)
    args.out.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    with open(args.out / f"steps-rank{rank}.jsonl", "w") as log:
        step, first = 0, time.time()
        while step < args.steps or time.time() - first < args.min_seconds:
            step += 1
            t0 = time.time()
            state = step_fn(state)
            t1 = time.time()
            report(step)
            log.write(json.dumps({"step": step, "t0": t0, "t1": t1}) + "\n")
            if step == args.steps:
                result = {"steps": step, "checksum": checksum(state)}
    (args.out / f"result-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

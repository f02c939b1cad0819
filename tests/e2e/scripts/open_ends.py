"""A gloo job that ends as many user scripts do: with a ThreadPoolExecutor and a stalwart Checkpointer
still open (plain ``python`` ends it at once), and optionally a non-daemon thread of its own that never
ends (--stuck-thread; --gil-stuck: one that holds the GIL, so the worker's own watchdog cannot run).
Rank 0 writes result.json; every start touches attempt-rank<r>-<restart>."""

import argparse
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart import report
from stalwart.checkpoint import Checkpointer

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--stuck-thread", action="store_true", help="rank 1 leaves a non-daemon thread that never ends")
parser.add_argument(
    "--gil-stuck", action="store_true", help="... and it takes the GIL for good once the script returned"
)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
(args.out / f"attempt-rank{rank}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}").touch()
pool = ThreadPoolExecutor(2, thread_name_prefix="user-pool")  # never shut down
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = Checkpointer(str(args.out / "ckpt"), memory_every=5)  # never closed
state = {"model": model, "optimizer": optimizer}
start = ckpt.restore(state)
x = torch.ones(2, 4)
for step in range(start + 1, args.steps + 1):
    loss = model(x).square().mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    optimizer.step()
    optimizer.zero_grad()
    pool.submit(time.sleep, 0.001)
    ckpt.save(step, state)
    report(step, loss=loss.item())
ckpt.wait()
if rank == 0:
    (args.out / "result.json").write_text(json.dumps({"step": args.steps, "weight": model.weight.sum().item()}))


def hog_the_gil() -> None:
    time.sleep(1.0)  # the script has returned by now
    re.match(r"(a+)+$", "a" * 64 + "b")  # backtracks for ages in C, never releasing the GIL


if (args.stuck_thread or args.gil_stuck) and rank == 1:
    target = hog_the_gil if args.gil_stuck else threading.Event().wait
    threading.Thread(target=target, name="user-never-ends").start()
dist.destroy_process_group()

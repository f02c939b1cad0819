"""A small distributed job for launcher tests: gloo all-reduce per step, state in a JSON file
(saved every step by rank 0, so a restart resumes exactly), one injected fault that fires once
(--fault), and faults from STALWART_CHAOS / `stalwart chaos` checked after every step."""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart import chaos, report, runtime

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--fault", choices=["none", "kill", "segv", "exception", "hang", "stop"], default="none")
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--at-step", type=int, default=5)
parser.add_argument("--slow-rank", type=int, default=-1, help="this rank computes --slow-factor × longer")
parser.add_argument("--slow-factor", type=float, default=3.0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
state_file = args.out / "state.json"
state = json.loads(state_file.read_text()) if state_file.exists() else {"step": 0, "x": 0.0}
marker = args.out / "fault-fired"
(args.out / f"attempt-rank{rank}-{os.environ['TORCHELASTIC_RESTART_COUNT']}").touch()

while state["step"] < args.steps:
    step = state["step"] + 1
    if args.fault != "none" and rank == args.rank and step == args.at_step and not marker.exists():
        marker.touch()
        runtime.fault_fired()  # when the fault began, for the agent's incident
        if args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif args.fault == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif args.fault == "exception":
            raise RuntimeError("injected failure")
        elif args.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            while True:  # an infinite loop that never reaches the collective
                pass
    t0 = time.perf_counter()
    time.sleep(args.step_s * (args.slow_factor if rank == args.slow_rank else 1.0))  # "compute"
    compute_s = time.perf_counter() - t0
    value = torch.tensor([float(rank + step)])
    dist.all_reduce(value)
    state = {"step": step, "x": state["x"] + value.item()}
    dist.barrier()
    if rank == 0:
        tmp = state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, state_file)
    dist.barrier()
    report(step, loss=state["x"], compute_s=compute_s)
    fault = chaos.due("step", step=step, rank=rank)  # STALWART_CHAOS / faults from `stalwart chaos`
    if fault is not None:
        fault.fire()

if rank == 0:
    (args.out / "result.json").write_text(json.dumps(state))
dist.destroy_process_group()
sys.exit(0)

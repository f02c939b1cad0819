"""A user script (not `stalwart train`) on CUDA over NCCL under `stalwart run`, for the GPU session
(benchmarks/gpu_session.sh): a Linear model and AdamW on cuda:LOCAL_RANK, gradients all-reduced over
NCCL, a stalwart ``Checkpointer`` snapshot every step, ``stalwart.report`` after each step, and the
chaos faults of ``--chaos`` (e.g. kill:rank=0:step=6) fired after the step, as the integrations do.
After a SIGKILL the agent restarts it and it restores from memory: every start prints where it
restored from; rank 0 writes OUT/result.json at the end. ``--backend gloo`` runs it on the CPU.

    stalwart run --standalone --nproc-per-node 1 --max-restarts 2 --chaos kill:rank=0:step=6 \\
        tests/gpu/scripts/nccl_restore.py --out runs/nccl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart import chaos, report
from stalwart.checkpoint import Checkpointer

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
parser.add_argument("--shm-dir", default="/dev/shm")
args = parser.parse_args()

local = int(os.environ.get("LOCAL_RANK", "0"))
device = torch.device(f"cuda:{local}") if args.backend == "nccl" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group(args.backend, device_id=device if device.type == "cuda" else None)
rank = dist.get_rank()
restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

torch.manual_seed(0)
model = torch.nn.Linear(256, 256).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = Checkpointer(str(args.out / "ckpt"), memory_every=1, persist_every_steps=0, shm_root=args.shm_dir)
state = {"model": model, "optimizer": optimizer}
start = ckpt.restore(state)
source = ckpt.last_restore.source if ckpt.last_restore else "fresh"
print(f"rank {rank} attempt {restart}: restored from {source} at step {start}", file=sys.stderr, flush=True)

x = torch.linspace(-1, 1, 8 * 256, device=device).reshape(8, 256)
for step in range(start + 1, args.steps + 1):
    loss = model(x * step).square().mean()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # over NCCL on the GPU
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ckpt.save(step, state)
    report(step, loss=loss.item())
    fault = chaos.due("step", step=step, rank=rank)
    if fault is not None:  # a kill "after step S" once this node holds S, as `stalwart train` does
        if fault.ends_process:
            ckpt.wait_node_holds(step)
        else:
            ckpt.wait()
        fault.fire()

ckpt.wait()
if rank == 0:
    result = {"step": args.steps, "weight_sum": model.weight.double().sum().item(), "attempt": int(restart)}
    result |= {"restored_from": source, "restore_step": start, "device": str(device), "backend": args.backend}
    (args.out / "result.json").write_text(json.dumps(result))
ckpt.close()
dist.destroy_process_group()

"""PP2×TP2 in one torchrun job: the debug model trained a few steps twice on the same batches, with
Falcon's scatter-gather (the default) and with the plain send; rank 0 writes both runs' losses and
every rank's bytes posted to isend (tests/e2e/test_pp_scatter_gather.py)."""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from stalwart.dist import init_distributed
from stalwart.models import build_model, model_args
from stalwart.plan.parallel import layout_from_config
from stalwart.runtime import exit_process
from stalwart.train.parallel import ParallelOptions, build_mesh, parallelize

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
torch.set_num_threads(1)
env = init_distributed("gloo")
layout = layout_from_config({"pp": 2, "tp": 2}, env.world_size, "ddp")
mesh = build_mesh(layout)
batches = torch.randint(0, 257, (args.steps, 8, 33), generator=torch.Generator().manual_seed(0))
result = {}
for name, scatter_gather in (("scatter_gather", True), ("plain", False)):
    with torch.device("meta"):
        model = build_model("debug", model_args("debug", vocab_size=257, max_seq_len=32))
    options = ParallelOptions(micro_batch=2, pp_scatter_gather=scatter_gather)
    pm = parallelize(model, layout, mesh, options, device=torch.device("cpu"), init_seed=0)
    opt = torch.optim.AdamW(list(pm.module.parameters()), lr=3e-3)
    losses, norms = [], []
    for ids in batches:
        losses.append(float(pm.forward_backward(ids[:, :-1], ids[:, 1:])))
        norms.append(float(pm.clip_grad_norm_(1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    sent = [None] * env.world_size
    dist.all_gather_object(sent, (pm.pipeline.sent.forward, pm.pipeline.sent.backward))
    result[name] = {"losses": losses, "grad_norms": norms, "sent": sent}
    dist.barrier()  # every rank's last sends complete before the next model (and the group's end)
if env.rank == 0:  # the 1-process reference: plain PyTorch, the same weights, batches and micro-batches
    model = build_model("debug", model_args("debug", vocab_size=257, max_seq_len=32))
    model.init_weights(0)
    opt = torch.optim.AdamW(list(model.parameters()), lr=3e-3)
    losses = []
    for ids in batches:
        total = 0.0
        for x in ids.split(2):
            loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten()) / 4
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    result["reference"] = {"losses": losses}
    Path(args.out).write_text(json.dumps(result))
dist.destroy_process_group()
exit_process(0)

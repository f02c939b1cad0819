"""A Lightning Fabric job for the integration tests: a tiny decoder (one transformer layer, 32 wide, dropout
on) on random tokens made here, DDP over gloo on the CPU, a warmup + linear LR schedule, the user's own loop.

--mode stalwart: StalwartFabric snapshots every --every steps (``fabric.save(fabric.snapshot_path, state)``
after each step, ``fabric.load(fabric.snapshot_path, state)`` before the loop); --mode native: a plain
``Fabric`` whose ``fabric.save`` writes a file every --every steps, the newest loaded after a restart (as
a Fabric loop does on its own). The data go through ResumableDataLoader, so either resumes at the batch
(stalwart's also restores Fabric's pass counter, which sets the sampler's epoch, and the RNG). Rank 0
logs each attempt's start (OUT/attempts.jsonl) and each completed step (OUT/steps.jsonl) and writes
OUT/result.json at the end (SHA-256 of the final weights and optimizer state).
"""

import argparse
import json
import os
from pathlib import Path

import lightning.fabric as lf
import torch
from lightning.fabric.strategies import DDPStrategy
from torch import nn

from stalwart import chaos
from stalwart.integrations.fabric import ResumableDataLoader, StalwartFabric
from stalwart.utils.hashing import state_dict_hash

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--ckpt", required=True, help="stalwart's checkpoint dir (or the native checkpoints' dir)")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--mode", choices=["stalwart", "native"], default="stalwart")
args = parser.parse_args()

VOCAB, SEQ = 64, 16


class TinyDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ - 1)
        logits = self.head(self.layer(self.embed(tokens[:, :-1]), src_mask=mask, is_causal=True))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


native = args.mode == "native"
setup = {"accelerator": "cpu", "devices": int(os.environ.get("LOCAL_WORLD_SIZE", "1"))}
setup["strategy"] = DDPStrategy(process_group_backend="gloo")
fabric = lf.Fabric(**setup) if native else StalwartFabric(args.ckpt, every_steps=args.every, **setup)
fabric.launch()
lf.seed_everything(0, verbose=False)
model = TinyDecoder()
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * max(0.0, 1 - s / 20))
model, opt = fabric.setup(model, opt)
# 40 sequences: an epoch is 5 steps at 2 ranks × 4, so a run crosses epochs (DistributedSampler, shuffled)
tokens = torch.randint(0, VOCAB, (40, SEQ), generator=torch.Generator().manual_seed(1234))
loader = fabric.setup_dataloaders(
    ResumableDataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4, shuffle=True)
)
state = {"model": model, "optimizer": opt, "scheduler": sched, "data": loader, "step": 0}

if native:
    saved = sorted(Path(args.ckpt).glob("step-*.ckpt"))
    if saved:
        fabric.load(saved[-1], state)
    restored = {"source": "native"}
else:
    fabric.load(fabric.snapshot_path, state)
    restored = {"source": fabric.snapshots.restored.source, "step": fabric.snapshots.restored.step}
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if fabric.global_rank == 0:
    with open(args.out / "attempts.jsonl", "a") as f:
        f.write(json.dumps({"attempt": attempt, **restored, "start": state["step"]}) + "\n")
while state["step"] < args.steps:
    for (batch,) in loader:
        fabric.backward(model(batch))
        opt.step()
        opt.zero_grad()
        sched.step()
        state["step"] += 1
        if fabric.global_rank == 0:
            with open(args.out / "steps.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": state["step"]}) + "\n")
        if not native:
            fabric.save(fabric.snapshot_path, state)  # fires --chaos faults at point "step"
        elif state["step"] % args.every == 0:
            fabric.save(Path(args.ckpt) / f"step-{state['step']:08d}.ckpt", state)
        if native and (fault := chaos.due("step", step=state["step"], rank=fabric.global_rank)):
            fault.fire()
        if state["step"] == args.steps:
            break
if not native:
    fabric.finish_snapshots()

model_hash = state_dict_hash(model.state_dict())
optim_hash = state_dict_hash(opt.state_dict()["state"])
if fabric.global_rank == 0:
    result = {"weights": model_hash, "optim": optim_hash, "global_step": state["step"]}
    (args.out / "result.json").write_text(json.dumps(result))

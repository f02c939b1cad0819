"""A Lightning job for the integration tests and benchmark: a tiny decoder (one transformer layer, 32
wide, dropout on) on random tokens made here, DDP over gloo on the CPU, a warmup + linear LR schedule.

--mode stalwart: StalwartCheckpoint snapshots every --every steps; --mode native: Lightning's own
ModelCheckpoint every --every steps, resumed with ckpt_path="last" after a restart. Both read the data
through ResumableDataLoader, so either resumes mid-epoch at the right batch. Rank 0 logs each attempt's
start (OUT/attempts.jsonl) and each completed step (OUT/steps.jsonl) and writes OUT/result.json at the
end (SHA-256 of the final weights and optimizer state).
"""

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from stalwart import chaos
from stalwart.integrations.lightning import ResumableDataLoader, StalwartCheckpoint
from stalwart.utils.hashing import state_dict_hash

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--ckpt", required=True, help="stalwart's checkpoint dir (or ModelCheckpoint's dirpath)")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--mode", choices=["stalwart", "native"], default="stalwart")
args = parser.parse_args()

VOCAB, SEQ = 64, 16


class TinyDecoder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ - 1)
        logits = self.head(self.layer(self.embed(tokens[:, :-1]), src_mask=mask, is_causal=True))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * max(0.0, 1 - s / 20))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> ResumableDataLoader:
        # 40 sequences: an epoch is 5 steps at 2 ranks × 4, so a run crosses epochs
        tokens = torch.randint(0, VOCAB, (40, SEQ), generator=torch.Generator().manual_seed(1234))
        return ResumableDataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4, shuffle=True)


class Recorder(pl.Callback):
    """Rank 0 logs where each attempt resumed (attempts.jsonl) and every step it completed (steps.jsonl).
    In native mode it fires --chaos faults itself."""

    def __init__(self, attempt: int) -> None:
        self.attempt, self.seen = attempt, -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = trainer.global_step
        if trainer.global_rank == 0:
            info = getattr(callback, "snapshots", None)
            restored = {"source": info.restored.source, "step": info.restored.step} if info else {"source": "native"}
            with open(args.out / "attempts.jsonl", "a") as f:
                f.write(json.dumps({"attempt": self.attempt, **restored, "start": trainer.global_step}) + "\n")

    def on_train_batch_end(self, trainer: pl.Trainer, *_: object) -> None:
        if trainer.global_step == self.seen:
            return
        self.seen = trainer.global_step
        if trainer.global_rank == 0:
            with open(args.out / "steps.jsonl", "a") as f:
                f.write(json.dumps({"attempt": self.attempt, "step": trainer.global_step}) + "\n")
        if native and (fault := chaos.due("step", step=trainer.global_step, rank=trainer.global_rank)):
            fault.fire()  # StalwartCheckpoint fires them in stalwart mode


native = args.mode == "native"
pl.seed_everything(0, verbose=False)
model = TinyDecoder()
if native:
    callback = ModelCheckpoint(dirpath=args.ckpt, every_n_train_steps=args.every, save_top_k=-1, save_last=True)
    plugins = []
else:
    callback = StalwartCheckpoint(args.ckpt, every_steps=args.every)
    plugins = [callback.checkpoint_io]
trainer = pl.Trainer(
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=DDPStrategy(process_group_backend="gloo"),
    max_steps=args.steps,
    callbacks=[Recorder(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))), callback],
    plugins=plugins,
    logger=False,
    enable_checkpointing=native,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    deterministic=True,
)
trainer.fit(model, ckpt_path="last" if native else callback.ckpt_path)

model_hash = state_dict_hash(model.state_dict())
optim_hash = state_dict_hash(trainer.optimizers[0].state_dict()["state"])
if trainer.global_rank == 0:
    result = {"weights": model_hash, "optim": optim_hash, "global_step": trainer.global_step}
    (args.out / "result.json").write_text(json.dumps(result))

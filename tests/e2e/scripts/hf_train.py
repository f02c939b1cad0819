"""A Hugging Face Trainer job for the integration tests and benchmark: a tiny GPT-2 (2 layers, 32 wide,
dropout on) on random tokens made here (nothing downloaded), DDP over gloo on the CPU.

--mode stalwart: StalwartCallback snapshots every --every steps; --mode native: the Trainer's own
checkpoints every --every steps (save_steps), resumed with resume_from_checkpoint=True after a restart.
Rank 0 logs each attempt's start (OUT/attempts.jsonl) and each completed step (OUT/steps.jsonl) and
writes OUT/result.json at the end (SHA-256 of the final weights and of the optimizer state).
"""

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from stalwart import chaos
from stalwart.utils.hashing import state_dict_hash

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--ckpt", required=True, help="stalwart's checkpoint dir (or the Trainer's output dir)")
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--every", type=int, default=3)
parser.add_argument("--mode", choices=["stalwart", "native"], default="stalwart")
args = parser.parse_args()


class RandomTokens(torch.utils.data.Dataset):
    """40 fixed sequences of 16 tokens: an epoch is 5 steps at 2 ranks × 4, so a run crosses epochs."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, 64, (40, 16), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Recorder(TrainerCallback):
    """Rank 0 logs every step it completed (steps.jsonl): what a restart redid, measured, not reported.
    In native mode it fires --chaos faults itself (StalwartCallback does in stalwart mode)."""

    def on_step_end(self, args_: TrainingArguments, state, control, **kwargs) -> None:
        if state.is_world_process_zero:
            with open(args.out / "steps.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": state.global_step}) + "\n")
        if native and (fault := chaos.due("step", step=state.global_step, rank=args_.process_index)):
            fault.fire()


attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
native = args.mode == "native"
torch.manual_seed(0)
config = GPT2Config(
    vocab_size=64,
    n_positions=16,
    n_embd=32,
    n_layer=2,
    n_head=2,
    n_inner=64,
    resid_pdrop=0.1,
    bos_token_id=None,
    eos_token_id=None,
)
model = GPT2LMHeadModel(config)
training_args = TrainingArguments(
    output_dir=args.ckpt if native else str(args.out / "hf"),
    max_steps=args.steps,
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    lr_scheduler_type="linear",
    warmup_steps=2,
    logging_steps=1,
    save_strategy="steps" if native else "no",
    save_steps=args.every,
    seed=0,
    use_cpu=True,
    ddp_backend="gloo",
    report_to=[],
    disable_tqdm=True,
    dataloader_num_workers=0,
    ddp_find_unused_parameters=False,
)
trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(), callbacks=[Recorder()])
rank = training_args.process_index

if native:
    # Resume from the Trainer's newest checkpoint. A restart can read it before every rank's files are
    # in (rank 0 writes the model, each rank its RNG), so rank 0 picks, and all take its choice.
    last = get_last_checkpoint(args.ckpt) if os.path.isdir(args.ckpt) else None
    picked = [last]
    torch.distributed.broadcast_object_list(picked, src=0)
    resume = picked[0]
    restored = {"source": "native" if resume else "fresh", "step": int(resume.rsplit("-", 1)[1]) if resume else 0}
    callback = None
else:
    from stalwart.integrations.hf import StalwartCallback

    callback = StalwartCallback(args.ckpt, every_steps=args.every)
    resume = callback.resume(trainer)
    info = callback.snapshots.restored
    restored = {"source": info.source, "step": info.step}

if rank == 0:
    with open(args.out / "attempts.jsonl", "a") as f:
        f.write(json.dumps({"attempt": attempt, **restored, "start": restored["step"]}) + "\n")

trainer.train(resume_from_checkpoint=resume)
model_hash = state_dict_hash(trainer.model.state_dict())
optim_hash = state_dict_hash(trainer.optimizer.optimizer.state_dict()["state"])
if rank == 0:
    result = {"weights": model_hash, "optim": optim_hash, "global_step": trainer.state.global_step}
    (args.out / "result.json").write_text(json.dumps(result))

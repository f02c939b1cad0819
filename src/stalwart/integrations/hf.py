"""Flash checkpoints for the Hugging Face ``Trainer`` (extra ``hf``): two lines in a training script.

    cb = StalwartCallback("runs/x/checkpoints", every_steps=10)          # memory snapshot every 10 steps
    trainer.train(resume_from_checkpoint=cb.resume(trainer))             # restore (collective), then train

``on_step_end`` snapshots, after each N-th optimizer step, the model, the optimizer and the Trainer's
small state (``TrainerState`` with its stateful callbacks, the LR scheduler, the grad scaler) plus
each rank's RNG into shared memory; the node's keeper persists them (DCP) when ``persist_every_steps``
says so, when a worker dies, and at the end. ``resume`` restores the newest snapshot (memory → storage
→ fresh) and writes it, per rank, as the checkpoint directory the Trainer's own resume reads — so the
Trainer itself restores the optimizer after creating its scheduler, skips the batches already seen in
the interrupted epoch (its sampler is seeded per epoch) and sets the RNG before the next batch, as
when it resumes from its own checkpoints. Nothing is read from storage when memory has the step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stalwart.integrations.common import Blob, Snapshots, check_packable

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("stalwart.integrations.hf needs transformers: pip install 'stalwart[hf]'") from err

# The file names of a Trainer checkpoint directory (transformers.trainer's constants; stable for years).
WEIGHTS = "pytorch_model.bin"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"
TRAINER_STATE = "trainer_state.json"


def trainer_state_json(trainer: Any) -> str:
    """``trainer.state`` as ``TrainerState.save_to_json`` writes it, with the ``ExportableState``
    callbacks (and ``TrainerControl``) as they are now, as the Trainer's own save records them."""
    state = dataclasses.asdict(trainer.state)
    by_name: dict[str, list[Any]] = {}
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            by_name.setdefault(type(cb).__name__, []).append(cb.state())
    state["stateful_callbacks"] = {
        **(state.get("stateful_callbacks") or {}),
        **{name: states[0] if len(states) == 1 else states for name, states in by_name.items()},
    }
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


def hf_rng_state(distributed: bool) -> dict[str, Any]:
    """The current RNG states in the layout of the Trainer's ``rng_state*.pth``."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return states


def _unwrap(optimizer: Any) -> Any:
    """Accelerate's ``AcceleratedOptimizer`` wraps the Trainer's optimizer after ``prepare``."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class StalwartCallback(TrainerCallback):
    """Memory snapshots every ``every_steps`` optimizer steps and their restore; see the module doc.
    ``persist_every_steps`` (0: only on failure and at the end) and other keyword arguments: as for
    :class:`~stalwart.checkpoint.Checkpointer` (e.g. ``shm_root``, ``keep_last``)."""

    def __init__(self, dir: str, *, every_steps: int = 1, persist_every_steps: int = 0, **options: Any) -> None:
        self.snapshots = Snapshots(dir, every_steps=every_steps, persist_every_steps=persist_every_steps, **options)
        self.shm_root = str(options.get("shm_root", "/dev/shm"))
        self.trainer: Any = None
        self.optimizer: Any = None
        self.resume_dir: Path | None = None
        self._checked = False
        self._live: dict[str, Any] | None = None  # one dict for every save: the Checkpointer caches by identity

    # -- restore -------------------------------------------------------------------------------------
    def resume(self, trainer: Trainer, fallback: str | bool | None = None) -> str | bool | None:
        """Restore the newest snapshot into ``trainer`` and return what to pass as
        ``trainer.train(resume_from_checkpoint=...)``: a directory in the Trainer's checkpoint format,
        or ``fallback`` (e.g. the path of your own newest checkpoint) when stalwart holds nothing. Collective:
        every rank calls it, after building the Trainer. Adds this callback to the Trainer if needed."""
        if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
            raise ValueError(
                "StalwartCallback supports the Trainer's DDP and single-process training; DeepSpeed and FSDP "
                "keep their own sharded checkpoint formats (use their checkpointing, or stalwart train with FSDP2)"
            )
        if trainer.model_init is not None:
            raise ValueError(
                "StalwartCallback cannot resume a Trainer built with model_init (train() makes a new model); "
                "pass the model itself: Trainer(model=...)"
            )
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        self.trainer = trainer
        if trainer.optimizer is None:
            trainer.create_optimizer()  # the Trainer keeps an optimizer it already has: this one
        self.optimizer = _unwrap(trainer.optimizer)
        state = self._state(template=True)
        step = self.snapshots.restore(state)
        if step == 0:
            return fallback
        self.resume_dir = self._write_resume_dir(state["trainer"].value)
        return str(self.resume_dir)

    def _state(self, template: bool = False) -> dict[str, Any]:
        if template:
            return {"model": self.trainer.model, "optim": self.optimizer, "trainer": Blob()}
        if self._live is None:
            self._live = {"model": self.trainer.model, "optim": self.optimizer, "trainer": Blob(self._capture)}
        return self._live

    def _capture(self) -> dict[str, Any]:
        t = self.trainer
        scaler = getattr(t.accelerator, "scaler", None)
        small = {
            "trainer_state": trainer_state_json(t),
            "scheduler": t.lr_scheduler.state_dict() if t.lr_scheduler is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        if not self._checked:
            check_packable(small, "the Trainer's scheduler, scaler or callback state")
            self._checked = True
        return small

    def _write_resume_dir(self, small: dict[str, Any]) -> Path:
        """This rank's checkpoint directory in the Trainer's format (in shared memory when it can)."""
        args = self.trainer.args
        root = self.shm_root if os.access(self.shm_root, os.W_OK) else None
        out = Path(tempfile.mkdtemp(prefix=f"stalwart-hf-resume-{args.process_index}-", dir=root))
        torch.save(self.trainer.model.state_dict(), out / WEIGHTS)
        torch.save(self.optimizer.state_dict(), out / OPTIMIZER)
        if small.get("scheduler") is not None:
            torch.save(small["scheduler"], out / SCHEDULER)
        if small.get("scaler") is not None:
            torch.save(small["scaler"], out / SCALER)
        distributed = args.world_size > 1
        name = f"rng_state_{args.process_index}.pth" if distributed else "rng_state.pth"
        torch.save(hf_rng_state(distributed), out / name)  # as restored: the Checkpointer set them
        (out / TRAINER_STATE).write_text(small["trainer_state"])
        return out

    def _drop_resume_dir(self) -> None:
        if self.resume_dir is not None:
            shutil.rmtree(self.resume_dir, ignore_errors=True)
            self.resume_dir = None

    # -- TrainerCallback -----------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            raise ValueError(
                "StalwartCallback needs its resume() before training, on every rank: "
                "trainer.train(resume_from_checkpoint=callback.resume(trainer))"
            )
        if _unwrap(self.trainer.optimizer) is not self.optimizer:
            raise ValueError(
                "the Trainer replaced the optimizer that StalwartCallback.resume() restored (DeepSpeed, FSDP or "
                "SageMaker create their own); use DDP or a single process"
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._drop_resume_dir()  # the Trainer has read it (the RNG file just before this step's batch)
        final = state.max_steps > 0 and state.global_step >= state.max_steps
        self.snapshots.after_step(state.global_step, self._state(), final=final)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._drop_resume_dir()
        self.snapshots.finish(self._state(), success=True)

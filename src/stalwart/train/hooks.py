"""What attaches to the training step without being threaded through it: chaos loss faults, the
training guard, metrics. The Trainer calls, for every hook in order:

    before_step(trainer, step)              # step = the one about to run (1-based)
    on_loss(loss) -> loss                   # each micro-batch loss before its backward (last PP stage)
    after_backward(trainer, stats)          # gradients reduced and clipped, nothing applied yet;
                                            #   a Verdict drops the gradients and skips the update
    after_step(trainer, stats)              # the update is applied, trainer.step == stats.step

``StepStats`` holds the step's numbers as *device* tensors; a hook that needs them on the host pays a
sync (the guard does, every step; metrics read them only once their copy to the host finished). The
loss's data-parallel all-reduce may still be under way in ``after_backward`` (``stats.settle()`` first);
the Trainer settles it before ``after_step``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from stalwart import chaos
from stalwart.train.guard import Verdict

if TYPE_CHECKING:
    from stalwart.train.trainer import Trainer


@dataclass
class StepStats:
    step: int
    loss: torch.Tensor  # global mean loss over the global batch, 0-dim fp32, the same on every rank
    grad_norm: torch.Tensor  # over all shards and stages, before clipping
    aux_loss: torch.Tensor  # MoE load-balancing loss (mean over ranks), 0 for dense models
    lr: float  # the rate this step's update used
    checkpoint_s: float = 0.0  # host time the snapshot call blocked this step (set by CheckpointHook)
    safe_step: int | None = None  # the newest step a lost node cannot take (--replica-sync/-overlap)
    loss_reduce: Any = None  # the loss's data-parallel all-reduce still under way (``settle`` ends it)
    dp_size: int = 1

    def settle(self) -> None:
        """Make ``loss`` the global mean: wait for its all-reduce (started asynchronously so that it
        overlaps clipping and the update; on CUDA the wait only orders streams). Idempotent."""
        if self.loss_reduce is not None:
            self.loss_reduce.wait()
            self.loss_reduce = None
            self.loss.div_(self.dp_size)


class StepHook:
    """No-op defaults; a hook overrides what it needs."""

    def before_step(self, trainer: Trainer, step: int) -> None:
        pass

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def after_backward(self, trainer: Trainer, stats: StepStats) -> Verdict | None:
        return None

    def after_step(self, trainer: Trainer, stats: StepStats) -> None:
        pass


class ChaosLossHook(StepHook):
    """STALWART_CHAOS ``nan``/``spike`` at point ``loss``: multiply the step's loss before backward,
    poisoning loss and gradients as a real numerical blow-up would."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.scale = 1.0

    def before_step(self, trainer: Trainer, step: int) -> None:
        fault = chaos.due("loss", step=step, rank=self.rank)
        self.scale = fault.scale if fault else 1.0

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scale == 1.0 else loss * self.scale


class GuardHook(StepHook):
    """The training guard judges every step before its update (stalwart.train.rollback). The loss and
    gradient norm are already equal on every rank; one all-reduce still makes every rank judge the
    very same numbers (a rank whose own value came out NaN makes the mean NaN everywhere). Reading
    them is a host sync every step: the price of judging before the update."""

    def __init__(self, guard: Any, world_size: int) -> None:
        self.guard, self.world_size = guard, world_size

    def after_backward(self, trainer: Trainer, stats: StepStats) -> Verdict | None:
        stats.settle()
        totals = torch.stack([stats.loss.double(), stats.grad_norm.double()])
        dist.all_reduce(totals)
        loss, grad_norm = (totals / self.world_size).tolist()
        return self.guard.judge(stats.step, loss, grad_norm)


class CheckpointHook(StepHook):
    """A flash snapshot after every applied step (the Checkpointer's policy decides which it keeps);
    the copy overlaps the next step. The last step is always persisted."""

    def __init__(self, ckpt: Any, total_steps: int) -> None:
        self.ckpt, self.total_steps = ckpt, total_steps

    def after_step(self, trainer: Trainer, stats: StepStats) -> None:
        t0 = time.perf_counter()
        try:
            self.ckpt.save(stats.step, trainer.state, persist=True if stats.step == self.total_steps else None)
        finally:  # a failed call's time too (its step's record is kept: MetricsHook.keep_applied)
            stats.checkpoint_s, stats.safe_step = time.perf_counter() - t0, self.ckpt.safe_step
        trainer.chaos_point("saved")  # a test's kill between the snapshot and the step's record

"""Flash checkpoints for ``lightning.Trainer`` (extra ``lightning``): a callback with a ``CheckpointIO``.

    ckpt = StalwartCheckpoint("runs/x/checkpoints", every_steps=10)
    trainer = L.Trainer(..., callbacks=[ckpt], plugins=[ckpt.checkpoint_io])
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt.ckpt_path)

After each N-th optimizer step (``on_train_batch_end``, where ``ModelCheckpoint(every_n_train_steps)``
saves) the callback snapshots the LightningModule, its optimizers and the rest of Lightning's own
checkpoint (loops and their progress, LR schedulers, callbacks, precision plugin, datamodule: what
``trainer.save_checkpoint`` would write besides weights and optimizer states) plus each rank's RNG
into shared memory. ``ckpt_path=ckpt.ckpt_path`` (always: a fresh start is told apart collectively)
makes Lightning ask the ``CheckpointIO`` for its checkpoint, which restores the newest snapshot
(memory → storage → fresh) and hands Lightning the same dictionary a checkpoint file would: Lightning
applies it in its own order. Lightning keeps no RNG in its checkpoints; the restored RNG states are
set again just before the first resumed step (before the new pass's seed draw when it starts an
epoch). The interrupted epoch's data position comes back through a resumable loader: use
:class:`ResumableDataLoader` for the training data (Lightning restores any loader with
``state_dict``/``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from stalwart.integrations.common import Blob, ResumableDataLoader, Snapshots, check_packable, reapply_deferred_rng

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
    from lightning.pytorch.plugins.io import TorchCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("stalwart.integrations.lightning needs lightning: pip install 'stalwart[lightning]'") from err

__all__ = ["ResumableDataLoader", "StalwartCheckpoint", "StalwartCheckpointIO"]
log = logging.getLogger("stalwart.integrations")
RESUME = "stalwart://resume"
# What travels as tensors through the Checkpointer, and what stays with the live objects.
_LIVE_KEYS = ("state_dict", "optimizer_states")
_HPARAM_KEYS = (
    pl.LightningModule.CHECKPOINT_HYPER_PARAMS_KEY,
    pl.LightningModule.CHECKPOINT_HYPER_PARAMS_NAME,
    pl.LightningModule.CHECKPOINT_HYPER_PARAMS_TYPE,
    "datamodule_hyper_parameters",
    "datamodule_hparams_name",
    "datamodule_hparams_type",
)


class StalwartCheckpointIO(TorchCheckpointIO):
    """Lightning's file IO, except for ``ckpt_path=StalwartCheckpoint.ckpt_path``: that checkpoint is
    the newest stalwart snapshot, restored by the callback."""

    def __init__(self, callback: StalwartCheckpoint) -> None:
        super().__init__()
        self.callback = callback

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if str(path) == RESUME:
            return self.callback.restore_checkpoint()
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


class StalwartCheckpoint(Callback):
    """Memory snapshots every ``every_steps`` optimizer steps and their restore; see the module doc.
    ``persist_every_steps`` (0: only on failure and at the end) and other keyword arguments: as for
    :class:`~stalwart.checkpoint.Checkpointer` (e.g. ``shm_root``, ``keep_last``)."""

    ckpt_path = RESUME

    def __init__(self, dir: str, *, every_steps: int = 1, persist_every_steps: int = 0, **options: Any) -> None:
        self.snapshots = Snapshots(dir, every_steps=every_steps, persist_every_steps=persist_every_steps, **options)
        self.checkpoint_io = StalwartCheckpointIO(self)
        self.trainer: Any = None
        self._live: dict[str, Any] | None = None
        self._seen_step = -1
        self._final_step: float = float("inf")
        self._checked = False

    # -- restore (through the CheckpointIO, before Lightning's setup) --------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) or strategy.restore_checkpoint_after_setup:
            raise ValueError(
                f"StalwartCheckpoint supports Lightning's DDP and single-device strategies, not "
                f"{type(strategy).__name__}: FSDP, DeepSpeed and model-parallel keep their own sharded checkpoints"
            )
        if trainer.strategy.checkpoint_io is not self.checkpoint_io:
            raise ValueError(
                "StalwartCheckpoint restores through its CheckpointIO: "
                "L.Trainer(callbacks=[ckpt], plugins=[ckpt.checkpoint_io])"
            )
        self.trainer = trainer

    def restore_checkpoint(self) -> dict[str, Any]:
        """Restore the newest snapshot (collective) and return it as a Lightning checkpoint dict; a
        fresh start gives the dict of the state as it is (loading it changes nothing)."""
        if self.trainer is None:
            raise ValueError(
                f"ckpt_path={RESUME!r} needs the StalwartCheckpoint callback in the same Trainer: "
                "L.Trainer(callbacks=[ckpt], plugins=[ckpt.checkpoint_io])"
            )
        module = self.trainer.lightning_module
        # Lightning creates the optimizers only after it loaded the checkpoint: restore into stand-ins
        # made the same way (configure_optimizers), whose states Lightning then loads into its own.
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        fresh = {
            "pytorch-lightning_version": pl.__version__,
            "epoch": 0,
            "global_step": 0,
            "optimizer_states": [copy.deepcopy(o.state_dict()) for o in optimizers],
            "lr_schedulers": [copy.deepcopy(c.scheduler.state_dict()) for c in schedulers],
        }
        state: dict[str, Any] = {"model": module, **{f"optim{i}": o for i, o in enumerate(optimizers)}}
        state["lightning"] = Blob()
        step = self.snapshots.restore(state)
        if step == 0:
            return {**fresh, "state_dict": module.state_dict()}
        self.snapshots.defer_rng()
        restored = dict(state["lightning"].value)
        restored["state_dict"] = module.state_dict()
        restored["optimizer_states"] = [o.state_dict() for o in optimizers]
        return restored

    # -- snapshots --------------------------------------------------------------------------------------
    def _state(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        if self._live is None:
            self._live = {"model": pl_module, **{f"optim{i}": o for i, o in enumerate(trainer.optimizers)}}
            self._live["lightning"] = Blob(self._capture)
        return self._live

    def _capture(self) -> dict[str, Any]:
        """Lightning's checkpoint dict without what the Checkpointer holds as live tensors."""
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in (*_LIVE_KEYS, *_HPARAM_KEYS):  # hyperparameters stay with the module itself
            checkpoint.pop(key, None)
        if not self._checked:
            check_packable(checkpoint, "Lightning's loop, scheduler or callback state")
            self._checked = True
        return checkpoint

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.trainer = trainer
        if trainer.ckpt_path != RESUME and trainer.global_rank == 0:
            log.warning(
                "StalwartCheckpoint snapshots, but fit(ckpt_path=%r) does not restore them: a restart will "
                "start from that instead; pass ckpt_path=ckpt.ckpt_path",
                trainer.ckpt_path,
            )
        if trainer.max_steps is not None and trainer.max_steps > 0:
            self._final_step = trainer.max_steps
        else:
            self._final_step = trainer.estimated_stepping_batches
        self._seen_step = trainer.global_step

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        reapply_deferred_rng()  # mid-epoch with another stateful loader (ResumableDataLoader did it already)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._seen_step:
            return  # accumulating gradients: no optimizer step in this batch
        self._seen_step = step
        self.snapshots.after_step(step, self._state(trainer, pl_module), final=step >= self._final_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.snapshots.finish(self._state(trainer, pl_module), success=True)

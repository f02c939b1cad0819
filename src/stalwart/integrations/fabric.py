"""Flash checkpoints for ``lightning.fabric.Fabric`` (extra ``lightning``): ``save``/``load`` through stalwart.

    fabric = StalwartFabric("runs/x/checkpoints", every_steps=10, accelerator="cuda", devices=8)  # was L.Fabric
    fabric.load(fabric.snapshot_path, state)          # before the loop, on every run
    fabric.save(fabric.snapshot_path, state)          # after each optimizer step
    fabric.finish_snapshots()                         # after the loop

A ``Fabric`` whose ``save`` and ``load`` take one more path, ``fabric.snapshot_path``: each ``save`` to it
counts one optimizer step and snapshots every ``every_steps``-th into shared memory (on every rank, with
the live modules and optimizers: nothing is copied before the background copy); ``load`` from it
restores the newest snapshot (memory → storage → fresh) into ``state`` as ``fabric.load`` would (modules,
optimizers and ``state_dict``/``load_state_dict`` objects in place, other values replaced in ``state``).
Every other path is Fabric's own file checkpoint, as before. The data position comes back with a
:class:`ResumableDataLoader` set up by Fabric and put in ``state``: its pass is skipped to the batch, and
Fabric's epoch counter for the ``DistributedSampler`` is restored with it. A ``CheckpointIO`` plugin cannot
do this: Fabric hands it the state dicts of rank 0 only.
"""

from __future__ import annotations

import inspect
from typing import Any

from stalwart.checkpoint import Checkpointer
from stalwart.integrations.common import Blob, ResumableDataLoader, Snapshots, check_packable

try:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy, SingleDeviceXLAStrategy
    from lightning.fabric.strategies.strategy import _Sharded
    from lightning.fabric.utilities.types import _Stateful
    from lightning.fabric.wrappers import _FabricDataLoader, _unwrap_objects
    from torch import nn
    from torch.optim import Optimizer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("stalwart.integrations.fabric needs lightning: pip install 'stalwart[lightning]'") from err

__all__ = ["ResumableDataLoader", "StalwartFabric"]
SNAPSHOT = "stalwart://snapshot"
_BLOB = "fabric"  # the key of everything but modules and optimizers in the Checkpointer's state
_FABRIC_ARGS = frozenset(inspect.signature(Fabric.__init__).parameters) - {"self"}


class StalwartFabric(Fabric):
    """``Fabric`` with stalwart's memory snapshots; see the module doc. ``dir``: where the keeper persists
    (path or URL); ``every_steps``: a snapshot every N optimizer steps (the most a restart redoes);
    ``persist_every_steps`` (0: only on failure and at the end). Keyword arguments that ``Fabric`` takes
    go to it, the others to :class:`~stalwart.checkpoint.Checkpointer` (``shm_root``, ``keep_last``, …)."""

    snapshot_path = SNAPSHOT

    def __init__(self, dir: str, *, every_steps: int = 1, persist_every_steps: int = 0, **kwargs: Any) -> None:
        fabric_args = {k: v for k, v in kwargs.items() if k in _FABRIC_ARGS}
        options = {k: v for k, v in kwargs.items() if k not in _FABRIC_ARGS}
        unknown = set(options) - set(inspect.signature(Checkpointer.__init__).parameters)
        if unknown:
            raise TypeError(f"StalwartFabric got unexpected keyword arguments {sorted(unknown)}")
        self.snapshots = Snapshots(dir, every_steps=every_steps, persist_every_steps=persist_every_steps, **options)
        super().__init__(**fabric_args)
        strategy = self.strategy
        if not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)) or isinstance(
            strategy, (_Sharded, SingleDeviceXLAStrategy)
        ):
            raise ValueError(
                f"StalwartFabric supports Fabric's DDP and single-device strategies, not {type(strategy).__name__}: "
                "FSDP, DeepSpeed, XLA and model-parallel keep their own sharded checkpoints"
            )
        self._step = 0
        self._live: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._checked = False

    # -- the Checkpointer's view of a Fabric state dict ---------------------------------------------------
    def _bind(self, state: dict[str, Any], template: bool = False) -> dict[str, Any]:
        """Modules and optimizers (unwrapped, as Fabric saves them) under their keys, the rest of
        ``state`` as one blob that reads it at each snapshot; kept while ``state`` holds the same objects."""
        if not isinstance(state, dict) or not state:
            raise ValueError("fabric.load/save(fabric.snapshot_path, state) need a non-empty state dict")
        if _BLOB in state:
            raise ValueError(f"state key {_BLOB!r} is reserved by StalwartFabric; rename it")
        live = {k: v for k, v in _unwrap_objects(state).items() if isinstance(v, (nn.Module, Optimizer))}
        if template:
            return {**live, _BLOB: Blob()}
        key = (id(state), *((k, id(v)) for k, v in live.items()))
        if self._live is None or self._live[0] != key:
            self._live = (key, {**live, _BLOB: Blob(lambda: self._capture(state))})
        return self._live[1]

    def _capture(self, state: dict[str, Any]) -> dict[str, Any]:
        unwrapped = _unwrap_objects(state)
        objects = {
            k: v.state_dict() if isinstance(v, _Stateful) else v
            for k, v in unwrapped.items()
            if not isinstance(v, (nn.Module, Optimizer))
        }
        loaders = {k: v._num_iter_calls for k, v in state.items() if isinstance(v, _FabricDataLoader)}
        captured = {"objects": objects, "loader_passes": loaders}
        if not self._checked:
            check_packable(captured, "the Fabric state's values besides modules and optimizers")
            self._checked = True
        return captured

    # -- Fabric's API -----------------------------------------------------------------------------------
    def load(
        self, path: Any, state: dict[str, Any] | None = None, strict: bool = True, **kwargs: Any
    ) -> dict[str, Any]:
        """``path=fabric.snapshot_path``: restore the newest snapshot into ``state`` (collective; a fresh
        start changes nothing) and continue counting steps from it; returns what the snapshot holds that
        ``state`` lacks (as ``fabric.load`` does). Other paths: Fabric's."""
        if str(path) != SNAPSHOT:
            return super().load(path, state, strict, **kwargs)
        if state is None:
            raise ValueError("fabric.load(fabric.snapshot_path, state) restores into a state dict; pass it")
        template = self._bind(state, template=True)
        self._step = self.snapshots.restore(template)
        if self._step == 0:
            return {}
        saved = template[_BLOB].value
        unwrapped = _unwrap_objects(state)
        missing = [k for k in state if k not in template and k not in saved["objects"]]
        if strict and missing:
            raise KeyError(f"the state key {missing[0]!r} is not in the snapshot; pass strict=False to keep it as is")
        remainder = {k: v for k, v in saved["objects"].items() if k not in state}
        for name, value in saved["objects"].items():
            if name not in state:
                continue
            if isinstance(unwrapped[name], _Stateful):
                unwrapped[name].load_state_dict(value)
            else:
                state[name] = value
        resumable = False
        for name, passes in saved["loader_passes"].items():
            wrapper = state.get(name)
            if isinstance(wrapper, _FabricDataLoader):
                loader = wrapper._dataloader
                resumable |= isinstance(loader, ResumableDataLoader)
                # A pass cut short resumes under its own epoch: the wrapper sets it at the next iter().
                wrapper._num_iter_calls = passes - 1 if getattr(loader, "skip", 0) else passes
        if resumable:
            self.snapshots.defer_rng()  # the loader sets the RNG again before the first resumed batch
        return remainder

    def save(self, path: Any, state: dict[str, Any], filter: dict[str, Any] | None = None) -> None:
        """``path=fabric.snapshot_path``: one optimizer step done; a snapshot if it is the N-th (it returns
        at once, the copy runs in the background), the step reported to the agent, chaos faults fired.
        Other paths: Fabric's file checkpoint."""
        if str(path) != SNAPSHOT:
            return super().save(path, state, filter)
        if filter is not None:
            raise ValueError("fabric.save(fabric.snapshot_path, ...) snapshots the whole state: no filter")
        self._step += 1
        self.snapshots.after_step(self._step, self._bind(state))

    def finish_snapshots(self, success: bool = True) -> None:
        """After the loop: the last step is committed to ``dir`` (with the keeper; snapshotted now if it
        was not), then the node's memory is freed. ``success=False`` keeps the snapshots for a restart."""
        self.snapshots.finish(self._live[1] if self._live else None, success=success)

    @property
    def step(self) -> int:
        """Optimizer steps done: those restored plus one per ``save(fabric.snapshot_path, ...)``."""
        return self._step

"""What every framework integration shares: the ``Checkpointer`` driven from a framework's step hook.

A framework owns its loop, so stalwart sees only its hooks: ``Snapshots.after_step`` runs after each
optimizer step (snapshot every ``every_steps``, the agent's progress record, chaos faults), and
``Snapshots.restore`` runs once, collectively, before the framework resumes. The framework's small
state (its loop counters, LR scheduler, grad scaler, callbacks) travels as one opaque leaf, a
``Blob``: its keys are not known before the framework has run a step, and a memory restore needs
the same keys in its template as in the snapshot. A framework's data position comes back through
``ResumableDataLoader``, which also sets the restored RNG states again at the right moment.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from stalwart import chaos, runtime
from stalwart.checkpoint import Checkpointer, RestoreInfo
from stalwart.checkpoint.state import rng_state, set_rng_state


def pack(value: Any) -> bytes:
    """``value`` as bytes (``torch.save``), restorable with ``weights_only=True``."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    """The inverse of :func:`pack`; never runs code from the checkpoint (``weights_only=True``)."""
    return torch.load(io.BytesIO(data), weights_only=True)


def check_packable(value: Any, what: str) -> None:
    """Fail at the first snapshot, not at the restore after a crash, when ``value`` holds a type that
    ``weights_only`` loading refuses (e.g. a custom class in a callback's state)."""
    try:
        unpack(pack(value))
    except Exception as err:
        raise ValueError(
            f"stalwart cannot snapshot {what}: it holds a value that cannot be restored safely "
            f"(torch.load(weights_only=True) refuses it: {str(err).splitlines()[0]}). Keep such state to "
            "tensors, numbers, strings, lists and dicts, or register the class with "
            "torch.serialization.add_safe_globals"
        ) from err


class Blob:
    """A ``Stateful`` carrying a framework's small state as one opaque leaf (``{"data": bytes}``).

    ``capture`` returns the state at save time; None makes the blob a restore template. After a
    restore, ``value`` holds what was saved (None before)."""

    def __init__(self, capture: Callable[[], Any] | None = None) -> None:
        self.capture = capture
        self.value: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"data": pack(self.capture()) if self.capture is not None else b""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        data = state.get("data", b"")
        self.value = unpack(data) if data else None


class Snapshots:
    """A ``Checkpointer`` driven from a framework's hooks. ``every_steps``: a memory snapshot every N
    optimizer steps (the most a restart can lose); ``persist_every_steps`` (a multiple of it, 0 = only
    on failure and at the end): the keeper writes that snapshot to ``dir``. Other keyword arguments go
    to :class:`~stalwart.checkpoint.Checkpointer`. It is built at the first use, once the framework
    has set up ``torch.distributed``."""

    def __init__(self, dir: str, *, every_steps: int = 1, persist_every_steps: int = 0, **options: Any) -> None:
        if not isinstance(dir, str) or not dir:
            raise ValueError(f"checkpoint dir must be a non-empty path or URL, got {dir!r}")
        if every_steps < 1:
            raise ValueError(f"every_steps={every_steps} must be ≥ 1: a snapshot every N optimizer steps")
        if persist_every_steps < 0 or persist_every_steps % every_steps:
            raise ValueError(
                f"persist_every_steps={persist_every_steps} must be 0 or a multiple of every_steps={every_steps}: "
                "only snapshotted steps can be persisted"
            )
        self.dir, self.every_steps, self.persist_every_steps = dir, every_steps, persist_every_steps
        self.options = options
        self._ckpt: Checkpointer | None = None
        self.restored: RestoreInfo | None = None
        self.resumed_rng: dict[str, Any] | None = None  # RNG states as restored, for a framework to re-apply
        self.last_step = 0
        self._final_persisted = -1

    @property
    def ckpt(self) -> Checkpointer:
        if self._ckpt is None:
            self._ckpt = Checkpointer(
                self.dir, memory_every=self.every_steps, persist_every_steps=self.persist_every_steps, **self.options
            )
        return self._ckpt

    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest snapshot (memory → storage → fresh) into ``state``; returns its step (0:
        fresh). Collective. The RNG states it set are kept in ``resumed_rng``: frameworks consume
        random numbers while they set up, so the integration applies them again just before the first
        resumed step (as the frameworks' own resume does)."""
        with runtime.phase("checkpoint"):
            step = self.ckpt.restore(state)
        self.restored = self.ckpt.last_restore
        self.resumed_rng = rng_state() if step else None
        self.last_step = step
        return step

    def reapply_rng(self) -> None:
        """Set the RNG states of the restore again (once); see :meth:`restore`."""
        if self.resumed_rng is not None:
            set_rng_state(self.resumed_rng)
            self.resumed_rng = None

    def defer_rng(self) -> None:
        """Set the restored RNG states again at the first resumed step: see :func:`reapply_deferred_rng`."""
        if self.resumed_rng is not None:
            _deferred_rng.append(self)

    def after_step(self, step: int, state: dict[str, Any], *, final: bool = False, loss: float | None = None) -> bool:
        """Call after optimizer step ``step``: snapshot if due (the ``final`` step always, marked for
        the keeper to persist: see :meth:`finish`), tell the agent, fire chaos faults due after it.
        Returns True if a snapshot was started."""
        persist = True if final and self.ckpt.use_keeper else None
        started = self.ckpt.save(step, state, persist=persist)
        if persist and started:
            self._final_persisted = step
        self.last_step = step
        runtime.report(step, loss=loss)
        self._chaos(step)
        return started

    def _chaos(self, step: int) -> None:
        """``--chaos kill:rank=R:step=S``: a fault that ends the process fires once the node holds
        the snapshot of S (as under ``stalwart train``), others once this rank's copy is done."""
        fault = chaos.due("step", step=step, rank=self.ckpt.rank)
        if fault is None:
            return
        if not fault.ends_process:
            self.ckpt.wait()
        elif not self.ckpt.wait_node_holds(step):
            print(f"stalwart chaos: step {step}: a snapshot of this node is not whole", file=sys.stderr)
        fault.fire()

    def finish(self, state: dict[str, Any] | None, success: bool = True) -> None:
        """End of training: with a keeper, the last step is committed to ``dir`` (snapshotted now if its
        step hook did not), also with no persist interval: then the keeper frees the node's memory,
        which it keeps while storage lacks the newest step. Then close. Without success the snapshots
        stay for a restart."""
        if self._ckpt is None:
            return
        try:
            if success:
                runtime.finished()
                step = self.last_step
                if step and self.ckpt.use_keeper:
                    if self._final_persisted != step and state is not None:
                        self.ckpt.save(step, state, persist=True)
                    if self.ckpt.persisting:
                        self.ckpt.ensure_durable(step)
                    else:
                        self.ckpt.wait(persist=True)
        finally:
            self.ckpt.close(success=success)
            self._ckpt = None


# Restores whose RNG states wait for the first resumed step. A DataLoader draws a seed from the global
# RNG when a pass starts: after a resume at an epoch's end the states must be set before that draw, after
# one mid-epoch once the resumed pass has fetched its first batch. ResumableDataLoader does both.
_deferred_rng: list[Snapshots] = []


def reapply_deferred_rng() -> None:
    """Set the RNG states of restores deferred with :meth:`Snapshots.defer_rng` (once)."""
    while _deferred_rng:
        _deferred_rng.pop().reapply_rng()


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that resumes mid-epoch: its state is how many batches of the current pass were
    handed out, and the next pass after a load skips that many (reading and dropping them: the sampler's
    order for the epoch is what makes this exact, e.g. a ``DistributedSampler`` set to the same epoch).
    A pass that had ended is not skipped: the next epoch starts whole. The RNG states of a deferred
    restore are set again before a whole pass starts (before its seed draw) or, in a resumed pass, just
    before its first kept batch is handed out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.consumed = 0
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip, self.skip = self.skip, 0
        self.consumed = 0
        if not skip:
            reapply_deferred_rng()  # a whole pass after a resume: the RNG as it was before this pass's seed draw
        for batch in super().__iter__():
            self.consumed += 1
            if self.consumed > skip:
                if self.consumed == skip + 1:
                    reapply_deferred_rng()  # a resumed pass: the RNG as it was after the batch before
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = int(state.get("consumed", 0))
        try:
            ended = consumed >= len(self)
        except TypeError:  # an iterable dataset without a length
            ended = False
        self.skip = 0 if ended else consumed

"""Per-step metrics without host syncs: metrics.jsonl (rank 0), the console, ``stalwart.report``.

Each step's loss, gradient norm and MoE loss stay on the device; ``HostCopy`` copies them to pinned
host memory asynchronously and records an event. A step's record is written once its copy finished
(``Event.query``, which never waits): on the CPU at once, on CUDA normally one step late. At log
steps (``train.log_every``), the last step, before a chaos fault and at the end, ``flush`` waits for
everything pending — the only places the metrics path may sync. Hang detection is unaffected
(``stalwart.report`` runs every step; its loss is given when already known), and so is straggler
detection (``compute_s`` comes from the section timer, itself resolved late on CUDA).

A step's record is written after its checkpoint call (it carries that call's time), and on CUDA a step
later still: a worker stopped in between would leave the step its restart resumes after (and on CUDA
the one before it) unlogged. So each snapshot carries those two records (``stage``: their values as a
device tensor that the snapshot copies with the weights, no sync), and a restart whose
``metrics.jsonl`` ends just before them writes them from there, marked ``restored`` (``open``).
"""

from __future__ import annotations

import json
import resource
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import stalwart
from stalwart.observe.progress import MetricsWriter, ProgressDisplay, last_logged_step
from stalwart.observe.records import RankRecords
from stalwart.observe.tensorboard import TensorBoardSink
from stalwart.runtime import worker_env
from stalwart.train.hooks import StepHook, StepStats

if TYPE_CHECKING:
    from stalwart.train.trainer import Trainer

HOST_COPY_MARK = "_stalwart_host_copy"  # set on staged host tensors: reading them is not a device sync


class HostCopy:
    """Device scalars copied to the host without waiting; ``ready()`` never blocks, ``read()`` waits
    only if the copy has not finished (call it where a sync is acceptable, or after ``ready()``)."""

    def __init__(self, values: torch.Tensor) -> None:
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event: Any = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = values.detach(), None
        setattr(self.host, HOST_COPY_MARK, True)

    def ready(self) -> bool:
        return self.event is None or bool(self.event.query())

    def read(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class _Pending:
    step: int
    values: HostCopy  # loss, grad norm, aux loss
    device_values: torch.Tensor  # the same, where they were computed (a snapshot may carry them)
    record: dict[str, Any]  # everything already known on the host
    rank_values: dict[str, Any]  # this rank's own: step start, host sections, memory


@dataclass
class MetricsHook(StepHook):
    """Builds one record per applied step; rank 0 writes them to ``metrics.jsonl`` and the console,
    and with ``rank`` given every rank its own (``stalwart.observe.records``): sections in ms, loss,
    grad norm, lr, tokens/s, MFU, memory."""

    out: Path
    total_steps: int
    log_every: int
    tokens_per_step: int
    world_size: int
    flops_per_token: float
    peak_flops: float | None
    main: bool
    moe: bool = False
    rank: int | None = None  # None: no per-rank records
    coords: dict[str, int] = field(default_factory=dict)  # the rank's mesh coordinates, for the timeline
    tensorboard: bool = False  # rank 0 also writes TensorBoard events (observe.tensorboard)
    step_times: list[float] = field(default_factory=list)
    last_loss: float | None = None  # of the newest written record
    _pending: deque[_Pending] = field(default_factory=deque)
    _rollback: dict[str, Any] | None = None
    _queued_step: int | None = None
    _writer: MetricsWriter | None = None
    _display: ProgressDisplay | None = None
    _records: RankRecords | None = None
    _tensorboard: TensorBoardSink | None = None
    _t0: float = 0.0
    _wall0: float = 0.0
    _staged: tuple[int, torch.Tensor, dict[str, Any], _Pending | None] | None = None  # see ``stage``
    _restored: dict[str, Any] | None = None

    def open(self, start_step: int, progress: bool = True) -> None:
        """Start writing (rank 0): appends when resuming — steps redone after a restart appear again
        (the later record wins); ``progress``: the console display."""
        path = self.out / "metrics.jsonl"
        self._writer = MetricsWriter(path, append=start_step > 0) if self.main else None
        restored, self._restored = self._restored, None  # what the restored snapshot carried
        if self._writer is not None and restored is not None and restored["step"] == start_step > 0:
            self._write_restored(restored, last_logged_step(path))
        self._display = ProgressDisplay(self.total_steps, start_step, self.log_every, enabled=self.main and progress)
        if self.tensorboard and self.main:
            self._tensorboard = TensorBoardSink(self.out / "tensorboard", start_step)
        if self.rank is not None:
            hist_dir = worker_env().progress_dir  # under `stalwart run`: /metrics histograms
            self._records = RankRecords(self.out, self.rank, self.coords, append=start_step > 0, hist_dir=hist_dir)

    def close(self) -> None:
        if self._display is not None:
            self._display.close()
        if self._writer is not None:
            self._writer.close()
        if self._records is not None:
            self._records.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def note_rollback(self, entry: dict[str, Any]) -> None:
        """Attach a rollback to the next step's record (every record stays a step record)."""
        self._rollback = entry

    def before_step(self, trainer: Trainer, step: int) -> None:
        trainer.timer.begin_step(step)
        self._queued_step = None  # step numbers repeat after a rollback
        self._wall0 = time.time()
        self._t0 = time.perf_counter()

    def after_step(self, trainer: Trainer, stats: StepStats) -> None:
        self._queue(trainer, stats)
        log_step = stats.step % self.log_every == 0 or stats.step == self.total_steps
        self.drain(wait=log_step)
        done = trainer.timer.resolved()
        if self._tensorboard is not None:
            for resolved in done:
                self._tensorboard.write_sections(resolved)
            if log_step:
                self._tensorboard.flush()
        if self._records is not None:
            for resolved in done:
                self._records.add_sections(resolved)
            if log_step:
                self._records.flush()
        sections = done[-1] if done else None
        known = self.last_loss if not self._pending and self.last_loss is not None else None
        stalwart.report(stats.step, loss=known, compute_s=sections["compute_s"] if sections else None)

    # -- the step's record rides in its snapshot -----------------------------------------------------
    def stage(self, trainer: Trainer, stats: StepStats) -> None:
        """After the update, before the checkpoint call: what the step's snapshot carries of the records
        not yet written, this step's (its step time without the checkpoint call) and the newest pending.
        Only references: ``state_dict`` builds the carried form when a snapshot is taken."""
        dt = time.perf_counter() - self._t0
        tps, mfu = self._rates(dt)
        this = {"step": stats.step, "lr": stats.lr, "tokens_per_s": tps, "step_time_s": dt, "mfu": mfu}
        this |= {"samples_consumed": trainer.sampler.consumed, "time": time.time()}
        newest = self._pending[-1] if self._pending else None  # on CUDA usually still on its way
        self._staged = (stats.step, _step_values(stats), this, newest)

    def state_dict(self) -> dict[str, Any]:
        if self._staged is None:  # a restore's template, or a snapshot before any step
            return _carried(0, torch.zeros(2, 3), [None, None])
        step, values, this, newest = self._staged
        if newest is None:
            return _carried(step, torch.stack([values, values]), [None, this])
        return _carried(step, torch.stack([newest.device_values, values]), [newest.record, this])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restored = dict(state)  # written by ``open`` if the log lacks it

    def _write_restored(self, carried: dict[str, Any], last_logged: int) -> None:
        """The carried records the log lacks, if it ends just before them (a log that ends earlier, or
        none, belongs to another run: a job started from a copy of this one's checkpoints)."""
        records = json.loads(carried["records"])
        if last_logged < carried["step"] - len(records):
            return
        assert self._writer is not None
        for record, (loss, grad_norm, aux) in zip(records, carried["values"].tolist()):
            if record is not None and last_logged < record["step"] <= carried["step"]:
                extra = {"aux_loss": aux} if self.moe else {}
                values = {"step": record["step"], "loss": loss, "grad_norm": grad_norm}
                self._writer.write({**values, **record, **extra, "restored": True})

    def _rates(self, step_time_s: float) -> tuple[float, float | None]:
        """Tokens/s and MFU of a step that took ``step_time_s``."""
        tps = self.tokens_per_step / step_time_s if step_time_s > 0 else 0.0
        mfu = (self.flops_per_token * tps / (self.peak_flops * self.world_size)) if self.peak_flops else None
        return tps, mfu

    def _queue(self, trainer: Trainer, stats: StepStats, **extra: Any) -> None:
        """Build the step's record; it is written once its values reach the host."""
        dt = time.perf_counter() - self._t0  # host time; the GPU's pace shows in it over a few steps
        self.step_times.append(dt)
        tps, mfu = self._rates(dt)
        record = {
            "step": stats.step,
            "lr": stats.lr,
            "tokens_per_s": tps,
            "step_time_s": dt,
            "mfu": mfu,
            "checkpoint_s": stats.checkpoint_s,
            "samples_consumed": trainer.sampler.consumed,
            "time": time.time(),
            **extra,
        }
        if self._rollback is not None:
            record["rollback"], self._rollback = self._rollback, None
        if stats.safe_step is not None:  # under --replica-sync/-overlap: what a lost node cannot take
            record["safe_step"] = stats.safe_step
        rank_values = {
            "time": self._wall0,
            "ms": {"checkpoint": round(stats.checkpoint_s * 1e3, 3), "step": round(dt * 1e3, 3)},
            "mem_mb": memory_mb(stats.loss.device),
        }
        staged = self._staged
        values = staged[1] if staged is not None and staged[0] == stats.step else _step_values(stats)
        self._pending.append(_Pending(stats.step, HostCopy(values), values, record, rank_values))
        self._queued_step = stats.step

    def keep_applied(self, trainer: Trainer, stats: StepStats) -> None:
        """A hook before this one failed after the step was applied (its checkpoint call, when a peer
        died mid-save): the record is still queued, marked ``interrupted`` — a restart may resume from
        this step's snapshot and never redo it. No progress report: the step did not complete."""
        if self._queued_step != stats.step:
            self._queue(trainer, stats, interrupted=True)
        self.drain()  # now: the launcher may stop this process any moment

    def drain(self, wait: bool = False) -> None:
        """Write the records whose values reached the host; with ``wait``, all of them (a sync)."""
        while self._pending and (wait or self._pending[0].values.ready()):
            p = self._pending.popleft()
            loss, grad_norm, aux = p.values.read()
            record = {"step": p.step, "loss": loss, "grad_norm": grad_norm, **p.record}
            if self.moe:
                record["aux_loss"] = aux
            self.last_loss = loss
            if self._writer is not None:
                self._writer.write(record)
            if self._tensorboard is not None:
                self._tensorboard.write(record)
            if self._display is not None:
                self._display.update(record)
            if self._records is not None:
                keys = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu")
                self._records.add_values(
                    p.step, {**{k: record[k] for k in keys}, "tokens": self.tokens_per_step, **p.rank_values}
                )
        if wait and self._records is not None:
            self._records.flush()


def _step_values(stats: StepStats) -> torch.Tensor:
    """The step's loss, gradient norm and MoE loss as one device tensor (one host copy, no sync)."""
    return torch.stack([stats.loss.float(), stats.grad_norm.float(), stats.aux_loss.float()])


def _carried(step: int, values: torch.Tensor, records: list[dict[str, Any] | None]) -> dict[str, Any]:
    """What a snapshot of ``step`` carries: two records' host fields as one JSON string (a fixed key set,
    so a restore's template, the empty one, matches every snapshot) and their loss, gradient norm and
    MoE loss as one 2×3 device tensor."""
    return {"step": step, "values": values, "records": json.dumps(records)}


def memory_mb(device: torch.device) -> float:
    """Peak memory of this rank in MiB: allocated on CUDA (a host-side counter: no sync), peak RSS on
    the CPU."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)

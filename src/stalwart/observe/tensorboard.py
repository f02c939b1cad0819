"""TensorBoard event files for rank 0's step records (``train.tensorboard``; the ``tensorboard`` extra).

Written through ``torch.utils.tensorboard`` to ``OUT_DIR/tensorboard``. A resumed run opens the writer
with ``purge_step`` at its first step, so the steps redone after a restart replace the lost ones in
TensorBoard instead of drawing a second curve over them.

A step's scalars (its record's and its sections') go as one event, written at log steps (``flush``),
not one event per scalar: ``SummaryWriter.add_scalar`` costs ~90 µs a call (an event, serialised and
checksummed in Python by the writer's thread), and ~16 calls a step were 1.5–1.9 ms of every training step
on the CPU (``benchmarks/step_overhead.py``). TensorBoard's own writer keeps events up to 2 minutes
before it writes them, so the buffer loses nothing a crash would not.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

SCALARS = {  # record key → TensorBoard tag
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/lr",
    "aux_loss": "train/aux_loss",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "checkpoint_s": "perf/checkpoint_blocking_s",
}


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def wanted(setting: str) -> bool:
    """``train.tensorboard``: auto (when the package is installed) | on | off."""
    if setting == "on" and not available():
        raise ValueError("train.tensorboard=on needs the tensorboard package: pip install 'stalwart[tensorboard]'")
    return setting == "on" or (setting == "auto" and available())


class TensorBoardSink:
    def __init__(self, log_dir: str | Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1 if start_step > 0 else None)
        self._steps: dict[int, dict[str, float]] = {}  # scalars by step, one event each at ``flush``

    def write(self, record: dict[str, Any]) -> None:
        """One step record (metrics.jsonl's), its numeric values as scalars."""
        step = record["step"]
        values = {tag: record.get(key) for key, tag in SCALARS.items()}
        self._scalars({tag: v for tag, v in values.items() if isinstance(v, int | float)}, step)
        if record.get("rollback"):
            self.writer.add_text("train/rollback", str(record["rollback"]), step)

    def write_sections(self, sections: dict[str, Any]) -> None:
        """One step's section times (``SectionTimer.resolved``: seconds per section, ``compute_s``,
        ``wait_s``), in ms."""
        step = sections.get("step")
        if step is None:
            return
        tags = {name: name.removesuffix("_s") if name in ("compute_s", "wait_s") else name for name in sections}
        times = {f"sections_ms/{tags[n]}": s * 1e3 for n, s in sections.items() if isinstance(s, float)}
        self._scalars(times, step)

    def _scalars(self, values: dict[str, float], step: int) -> None:
        self._steps.setdefault(step, {}).update(values)

    def flush(self) -> None:
        """Each buffered step as one event: what ``add_scalar`` writes for each value, in one summary."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        for step, values in self._steps.items():
            summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items()])
            self.writer.file_writer.add_summary(summary, step)
        self._steps.clear()

    def close(self) -> None:
        self.flush()
        self.writer.close()

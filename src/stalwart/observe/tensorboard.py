"""TensorBoard event files for rank 0's step records (``train.tensorboard``; the ``tensorboard`` extra).

Written through ``torch.utils.tensorboard`` to ``OUT_DIR/tensorboard``. A resumed run opens the writer
with ``purge_step`` at its first step, so the steps redone after a restart replace the lost ones in
TensorBoard instead of drawing a second curve over them.
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

    def write(self, record: dict[str, Any]) -> None:
        """One step record (metrics.jsonl's), its numeric values as scalars."""
        step = record["step"]
        for key, tag in SCALARS.items():
            value = record.get(key)
            if isinstance(value, int | float):
                self.writer.add_scalar(tag, value, step)
        if record.get("rollback"):
            self.writer.add_text("train/rollback", str(record["rollback"]), step)

    def write_sections(self, sections: dict[str, Any]) -> None:
        """One step's section times (``SectionTimer.resolved``: seconds per section, ``compute_s``,
        ``wait_s``), in ms."""
        step = sections.get("step")
        for name, seconds in sections.items():
            if step is not None and isinstance(seconds, float):
                tag = name.removesuffix("_s") if name in ("compute_s", "wait_s") else name
                self.writer.add_scalar(f"sections_ms/{tag}", seconds * 1e3, step)

    def close(self) -> None:
        self.writer.close()

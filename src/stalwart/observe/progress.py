"""Per-step metrics to JSONL, and a console display that suits a terminal or a log file."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class MetricsWriter:
    """Appends one JSON object per step; flushed each line so a crash loses nothing written."""

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = open(self.path, "a" if append else "w")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def last_logged_step(path: str | Path) -> int:
    """The step of the last whole record in a metrics file (-1: none); reads only its tail."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return -1
    for line in reversed(lines):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(json.loads(line)["step"])
    return -1


def format_metrics(m: dict[str, Any]) -> str:
    parts = [
        f"step {m['step']}",
        f"loss {m['loss']:.4f}",
        f"gnorm {m['grad_norm']:.3f}",
        f"lr {m['lr']:.2e}",
        f"{m['tokens_per_s']:,.0f} tok/s",
        f"{m['step_time_s'] * 1e3:.0f} ms",
    ]
    if m.get("mfu") is not None:
        parts.append(f"MFU {m['mfu']:.1%}")
    return " · ".join(parts)


class ProgressDisplay:
    """A live rich progress bar on a terminal; one plain line every `every` steps otherwise
    (to stderr, so stdout stays clean for --json)."""

    def __init__(self, total: int, start: int = 0, every: int = 10, enabled: bool = True) -> None:
        self.enabled, self.every, self.total = enabled, every, total
        self.console = Console(stderr=True)
        self._progress: Progress | None = None
        if enabled and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=self.console,
                transient=False,
            )
            self._task = self._progress.add_task("", total=total, completed=start)
            self._progress.start()

    def update(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = metrics["step"]
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=format_metrics(metrics))
        elif step % self.every == 0 or step == self.total:
            print(format_metrics(metrics), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()

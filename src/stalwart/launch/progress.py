"""The agent's half of the progress channel: consistent reads of every local rank's record.

Workers write their records with ``stalwart.report`` (``stalwart.runtime.progress``: a 64-byte
seqlocked record per rank in ``STALWART_PROGRESS_DIR``); the node agent reads them here when it
heartbeats and when it checks for hangs. The record format and file naming live in the runtime, the
one contract both sides import.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from dataclasses import dataclass
from pathlib import Path

from stalwart.runtime.progress import BODY, PHASES, SEQ, SIZE, record_path, seq_view


@dataclass(frozen=True)
class Progress:
    """One rank's record as the agent read it."""

    rank: int
    step: int  # -1 before the first report
    time: float  # wall-clock time of the last report (or of channel creation)
    phase: str
    loss: float
    reports: int
    compute_s: float = math.nan  # the step's own work (no communication wait), for straggler detection

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.time


class ProgressReader:
    """The agent side: consistent snapshots of every local rank's record (seqlock: the sequence
    number is read before and after copying; equal and even means the copy is whole)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}

    def _map(self, rank: int) -> tuple[mmap.mmap, memoryview] | None:
        if rank not in self._maps:
            path = record_path(self.directory, rank)
            try:
                with open(path, "rb") as f:
                    if os.fstat(f.fileno()).st_size < SIZE:
                        return None
                    m = mmap.mmap(f.fileno(), SIZE, prot=mmap.PROT_READ)
                    self._maps[rank] = (m, seq_view(m))
            except FileNotFoundError:
                return None
        return self._maps[rank]

    def read(self, rank: int) -> Progress | None:
        mapped = self._map(rank)
        if mapped is None:
            return None
        m, seq = mapped
        for _ in range(1000):
            before = seq[0]
            data = m[:SIZE]
            after = seq[0]
            if before == after and before % 2 == 0:
                step, stamp, phase_index, loss, reports, compute = BODY.unpack_from(data, SEQ.size)
                name = PHASES[phase_index] if phase_index < len(PHASES) else "train"
                return Progress(rank, step, stamp, name, loss, reports, compute)
        return None

    def forget(self, rank: int) -> None:
        """Drop a rank's mapping (its worker is being replaced and will recreate the record)."""
        mapped = self._maps.pop(rank, None)
        if mapped is not None:
            mapped[1].release()
            mapped[0].close()

    def close(self) -> None:
        for rank in list(self._maps):
            self.forget(rank)

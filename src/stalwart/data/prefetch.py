"""The next micro-batches read (and moved to the device) in the background, while the current step runs.

``BatchLoader.next()`` serves this rank's share of the next global batch. With ``depth`` > 0 a reader
thread works ``depth`` batches ahead: it reads the tokens (memory-mapped shards) and, on CUDA, pins
them and copies them to the device on a side stream, so the step finds its batch ready while the
previous step's gradients were still being reduced.

Prefetching never touches the sampler's state: a batch is looked up by the sampler state it starts
from (``consumed`` and the skip ranges) and the sampler advances only when the step takes it. A
checkpoint therefore holds exactly the batches trained on; a restore, a guard rollback or a skip
changes that state, the queued batches no longer match and are dropped (read again from the new
state). Served samples and their order are the same whatever ``depth`` is.

Ranks of one tensor-parallel group train on the same batch. With ``share`` (a gloo group over one TP
group's ranks, its first member ``share_src``) only that first rank reads; the tokens are broadcast
over the group on the host (a node-local copy, as MegaScale's one loader per machine; a gloo group of
its own, so it never interleaves with the model's collectives on the main thread). Every rank submits
the same sequence of reads, and no submitted read is ever cancelled, so the broadcasts pair up.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stalwart.data.dataset import TokenDataset
from stalwart.data.sampler import GlobalSampler

Key = tuple[int, tuple[tuple[int, int], ...]]  # the sampler state a batch starts from


@dataclass
class _Slot:
    key: Key
    after: int  # sampler.consumed once this batch is taken
    result: Future  # (rows on the device, CUDA event or None)


class BatchLoader:
    def __init__(
        self,
        dataset: TokenDataset,
        sampler: GlobalSampler,
        rank: int,
        world_size: int,
        depth: int,
        device: torch.device,
        share: dist.ProcessGroup | None = None,
        share_src: int = 0,
    ) -> None:
        if depth < 0:
            raise ValueError(f"data.prefetch must be ≥ 0 (batches read ahead), got {depth}")
        self.dataset, self.sampler, self.rank, self.world_size = dataset, sampler, rank, world_size
        self.depth, self.device = depth, device
        self.share, self.share_src = share, share_src
        self.reads = 0  # batches this rank read from storage itself (tests: one read per TP group)
        self._queue: deque[_Slot] = deque()
        self._tasks: queue.SimpleQueue[tuple[Future, np.ndarray] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stream: Any = None
        if depth and device.type == "cuda":
            self._stream = torch.cuda.Stream(device)

    def _key(self) -> Key:
        return self.sampler.consumed, tuple(self.sampler.skip_ranges)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's share of the next global batch; advances the sampler."""
        key = self._key()
        if self._queue and self._queue[0].key != key:  # restored, rolled back or skipped since queued
            self._queue.clear()  # already submitted reads still run (and pair up across the group)
        if not self._queue:
            self._submit(key)
        slot = self._queue.popleft()
        rows, event = slot.result.result()
        self.sampler.consumed = slot.after
        while len(self._queue) < self.depth:
            last = self._queue[-1] if self._queue else slot
            self._submit((last.after, last.key[1]))
        if event is not None:  # the copy ran on the side stream: order it before this stream's use
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            rows.record_stream(current)
        return rows[:, :-1], rows[:, 1:]

    def _submit(self, key: Key) -> None:
        ids, after = self.sampler.batch_at(key[0], self.rank, self.world_size)
        result: Future = Future()
        if self.depth:
            self._start()
            self._tasks.put((result, ids))
        else:
            result.set_result((self._read(ids), None))
        self._queue.append(_Slot(key, after, result))

    def _read(self, ids: np.ndarray) -> torch.Tensor:
        """The batch's token rows (len(ids), seq_len + 1), read here or received from the TP group's reader."""
        failed: BaseException | None = None
        if self.share is None or dist.get_rank() == self.share_src:
            try:
                rows = self.dataset.rows(ids)
            except Exception as err:
                if self.share is None:
                    raise
                # The group still gets one broadcast per read (else every later read pairs with the wrong
                # batch): rows of -1, never a token id, tell the others this read failed.
                failed, rows = err, torch.full((len(ids), self.dataset.seq_len + 1), -1, dtype=torch.int64)
            self.reads += 1
        else:
            rows = torch.empty((len(ids), self.dataset.seq_len + 1), dtype=torch.int64)
        if self.share is not None:
            dist.broadcast(rows, src=self.share_src, group=self.share)
            if failed is not None:
                raise failed
            if rows.numel() and int(rows[0, 0]) < 0:
                raise RuntimeError(f"the TP group's reader (rank {self.share_src}) failed to read this batch")
        return rows

    def _to_device(self, rows: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self._stream is None:
            return rows, None
        with torch.cuda.stream(self._stream):
            moved = rows.pin_memory().to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return moved, event

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="stalwart-prefetch", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while (task := self._tasks.get()) is not None:
            result, ids = task
            try:
                result.set_result(self._to_device(self._read(ids)))
            except BaseException as e:  # handed to the step that takes this batch
                result.set_exception(e)

    def close(self, timeout: float | None = None) -> None:
        """Let the submitted reads finish (bounded by ``timeout``: after a failure a peer may be gone;
        the thread is a daemon), then stop the reader."""
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(timeout)
            self._thread = None
        self._queue.clear()

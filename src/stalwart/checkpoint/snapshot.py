"""Tier 1: double-buffered memory snapshots in file-backed shared memory (docs/checkpoint.md, "Tier 1:
memory snapshots"): per rank two slots of ``slot<i>.{bin,obj,json}``, the header only for a complete
slot, locked with ``flock`` so that training never waits for the keeper. The copy runs on a background
thread, which also issues the device-to-host copies (one ``cudaMemcpyAsync`` per tensor, ~10 µs of host
time each: ~6 ms per save of a 280M model with AdamW on an H200) after an event the save records on
the training stream: the save call records the event instead of issuing the copies.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import mmap
import os
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.planner import WriteItemType

from stalwart import chaos
from stalwart._compat import copy_tensors
from stalwart.checkpoint.hparams import dcp_hyperparameters
from stalwart.checkpoint.shm import (
    FORMAT,
    MAX_SLOTS,
    SLOTS,
    JobPaths,
    SlotInfo,
    atomic_write,
    complete_slots,
    pin_slot,
)
from stalwart.checkpoint.slot_file import SlotFile, entry_tensor, shm_free_bytes
from stalwart.checkpoint.state import Captured

log = logging.getLogger("stalwart.checkpoint")
ALIGN = 64


class SnapshotView:
    """A complete slot opened for reading under a shared lock (keeper persist, restore)."""

    def __init__(self, paths: JobPaths, info: SlotInfo) -> None:
        self.info = info
        self._map: mmap.mmap | None = None
        self._fd, header = pin_slot(paths, info)
        self._size = int(header["data_bytes"])
        obj_path = paths.slot(info.rank, info.slot, "obj")
        blob = obj_path.read_bytes()
        if zlib.crc32(blob) != header["objects_crc32"]:
            self.close()
            raise ValueError(f"rank {info.rank} slot {info.slot}: objects file does not match its header")
        import io

        loaded = torch.load(io.BytesIO(blob), weights_only=True)
        if not (isinstance(loaded, tuple) and len(loaded) == 2):
            self.close()
            raise ValueError(f"rank {info.rank} slot {info.slot}: snapshot written by an older stalwart version")
        objects, groups = loaded
        self.entries: dict[str, dict[str, Any]] = {e["key"]: e for e in header["entries"]}
        self.mappings = {k: tuple(v) for k, v in header["mappings"].items()}
        # checkpoint keys: hyperparameters spelled out in both of DCP's optimizer layouts (hparams)
        self.objects: dict[str, Any] = dict(objects)
        for name, optim_groups in groups.items():
            hyper, paths = dcp_hyperparameters(name, optim_groups)
            self.objects.update(hyper)
            self.mappings.update(paths)

    @property
    def step(self) -> int:
        return self.info.step

    def tensor(self, key: str) -> torch.Tensor:
        """A zero-copy view of one entry (maps the slot on first use)."""
        if self._map is None and self._size:
            self._map = mmap.mmap(self._fd, self._size, access=mmap.ACCESS_COPY)  # private: never written
        return entry_tensor(self._map, self.entries[key])

    def read_into(self, key: str, dst: torch.Tensor) -> None:
        """Copy one entry into ``dst``: a single ``preadv`` for contiguous CPU tensors (no page
        faults on a mapping, no unmap), a mapped view otherwise."""
        e = self.entries[key]
        if dst.is_cuda or not dst.is_contiguous() or str(dst.dtype).removeprefix("torch.") != e["dtype"]:
            dst.copy_(self.tensor(key))
            return
        buf = memoryview(dst.reshape(-1).view(torch.uint8).numpy()) if e["nbytes"] else memoryview(b"")
        done = 0
        while done < e["nbytes"]:
            n = os.preadv(self._fd, [buf[done:]], e["offset"] + done)
            if n <= 0:
                raise OSError(f"short read of {key} from rank {self.info.rank} slot {self.info.slot}")
            done += n

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # tensors still reference it; the GC unmaps it later
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)  # also releases the flock
            self._fd = -1

    def __enter__(self) -> SnapshotView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plan_layout(captured: Captured) -> tuple[list[dict[str, Any]], int]:
    """Entry table for the tensors: where each lives in the slot and which DCP chunk it is."""
    plan = create_default_local_save_plan(captured.tensors, True)
    chunks = {item.index.fqn: item for item in plan.items if item.type != WriteItemType.BYTE_IO}
    entries, offset = [], 0
    for key, local in captured.sources.items():
        item = chunks[key]
        assert item.tensor_data is not None and item.tensor_data.chunk is not None
        nbytes = local.numel() * local.element_size()
        entries.append(
            {
                "key": key,
                "dtype": str(local.dtype).removeprefix("torch."),
                "shape": list(local.shape),
                "offset": offset,
                "nbytes": nbytes,
                "item": item.type.name,
                "chunk_offsets": list(item.tensor_data.chunk.offsets),
                "global_shape": list(item.tensor_data.size),
            }
        )
        offset += -(-nbytes // ALIGN) * ALIGN
    return entries, offset


def epoch_of(header: dict[str, Any]) -> int:
    """The execution that took a snapshot (0 in headers written before epochs were recorded)."""
    return int(header.get("epoch", 0))


def trajectory_of(header: dict[str, Any]) -> tuple[int, int]:
    """(epoch, restores before it in that execution): ordered as the snapshots were taken, on any clock.
    A restore (a restart's, or a rollback's within one execution) begins a later trajectory."""
    return epoch_of(header), int(header.get("restores", 0))


def captured_at(header: dict[str, Any]) -> float:
    """When a snapshot's state was taken: before its step's execution could fail, even if its copy was
    published after (a header without ``captured`` is older: its publication time)."""
    return float(header.get("captured", header["time"]))


class SnapshotWriter:
    """Writes this rank's snapshots, alternating slots; one copy in flight at a time."""

    def __init__(self, paths: JobPaths, rank: int, world_size: int, slots: int = len(SLOTS), epoch: int = 0) -> None:
        if not len(SLOTS) <= slots <= MAX_SLOTS:
            raise ValueError(f"memory snapshots take {len(SLOTS)} to {MAX_SLOTS} slots per rank, not {slots}")
        self.paths, self.rank, self.world_size, self.epoch = paths, rank, world_size, epoch
        self.restores = 0  # restores in this execution (the Checkpointer counts them): ``trajectory_of``
        paths.rank_dir(rank).mkdir(parents=True, exist_ok=True)
        self.slots = [SlotFile(paths.slot(rank, i, "bin")) for i in range(slots)]
        existing = complete_slots(paths, rank)
        self.generation = existing[0].generation if existing else 0
        self.latest_slot: int | None = existing[0].slot if existing else None
        self._generations = {s.slot: s.generation for s in existing}  # what each slot's header says
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stalwart-snapshot")
        self._future: Future[None] | None = None
        self._copied = threading.Event()
        self._copied.set()
        self._cuda_event: Any = None  # the device-to-host copies' end, on the side stream
        self._stream: Any = None  # that side stream (created by the first save on the training device)
        # (signature, entries, size, any CUDA tensor): planned again only when the signature changes
        self._layout: tuple[Any, list[dict[str, Any]], int, bool] | None = None
        self._encoded: tuple[list[dict[str, Any]], dict[str, Any], str] | None = None  # see ``_header``
        # waits: ``wait_s`` the optimizer hook's (a step held for the copy), ``save_wait_s`` a save call's for
        # the previous snapshot, ``end_wait_s`` every other (the run's final wait, replica sync, rollback)
        self.stats = {"snapshots": 0, "skipped": 0, "wait_s": 0.0, "save_wait_s": 0.0, "end_wait_s": 0.0}
        self.stats |= {"copy_s": 0.0, "last_step": None}

    # -- main thread -----------------------------------------------------------------------------
    def start(self, step: int, captured: Captured, persist: bool) -> bool:
        """Begin the snapshot of ``step``; returns False if it was skipped (both slots busy)."""
        self.wait("save_wait_s")
        sig = captured.signature
        if self._layout is None or self._layout[0] != sig or sig is None:
            entries, size = plan_layout(captured)
            self._check_space(size)
            self._layout = (sig, entries, size, any(t.is_cuda for t in captured.sources.values()))
            for slot in self.slots:  # reserve and map both slots now: a one-time cost at the first save
                if slot.try_lock():
                    try:
                        slot.ensure(size)
                    finally:
                        slot.unlock()
        _, entries, size, cuda = self._layout
        slot = self._acquire()
        if slot is None:
            self.stats["skipped"] += 1
            log.warning(
                "rank %d: memory snapshot of step %d skipped: both slots are busy (the keeper is "
                "persisting one); the previous snapshot stays valid",
                self.rank,
                step,
            )
            return False
        self.paths.slot(self.rank, slot, "json").unlink(missing_ok=True)  # slot invalid from here on
        self.slots[slot].ensure(size)
        self._copied.clear()
        self._cuda_event = None
        ready = None
        if cuda:  # the step's updates, as queued on the training stream: the copies wait for them there
            self.slots[slot].pin_for_cuda()  # once per slot (page-locking: tens of ms for GBs)
            self._stream = self._stream or torch.cuda.Stream()
            ready = torch.cuda.Event()
            ready.record()
        self._future = self._pool.submit(self._run, step, slot, entries, size, captured, persist, ready, time.time())
        return True

    def wait_copied(self) -> None:
        """Block until no tensor is still being read (the optimizer pre-step hook)."""
        if not self._copied.is_set():
            t0 = time.perf_counter()
            self._copied.wait()
            self.stats["wait_s"] += time.perf_counter() - t0
        if self._cuda_event is not None:
            torch.cuda.current_stream().wait_event(self._cuda_event)  # GPU-side wait, host continues
        self._raise_if_failed()

    def wait(self, stat: str = "end_wait_s") -> None:
        """Block until the in-flight snapshot is complete (header published); the time goes to ``stat``."""
        if self._future is not None:
            t0 = time.perf_counter()
            self._future.result()
            self.stats[stat] += time.perf_counter() - t0
            self._future = None

    def finish_in_flight(self, timeout: float) -> None:
        """From any thread (a SIGTERM's, ``runtime.sigterm``): wait up to ``timeout`` s for the snapshot
        under way to be published; its failure is not raised here."""
        future = self._future
        if future is not None:
            concurrent.futures.wait([future], timeout=timeout)

    def _raise_if_failed(self) -> None:
        if self._future is not None and self._future.done() and self._future.exception() is not None:
            self.wait()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _check_space(self, size: int) -> None:
        have = sum(os.fstat(s.fd).st_size for s in self.slots)
        n = len(self.slots)
        need = n * size - have
        free = shm_free_bytes(self.paths.root)
        if need > free:
            raise ValueError(
                f"memory snapshots need {n * size / 2**20:.1f} MiB in {self.paths.root} ({n} slots of "
                f"{size / 2**20:.1f} MiB) but only {free / 2**20:.1f} MiB are free; enlarge /dev/shm (Docker: "
                "--shm-size), point checkpoint.shm_dir at a larger tmpfs, or disable checkpointing"
            )

    def _acquire(self) -> int | None:
        """The slot holding the oldest snapshot (an empty or torn one first), never the newest unless
        the others are pinned."""
        order = sorted(range(len(self.slots)), key=lambda i: (i == self.latest_slot, self._generation(i)))
        for i in order:
            if self.slots[i].try_lock():
                return i
        return None

    def _generation(self, slot: int) -> int:
        """The generation of the slot's snapshot (-1: none, the slot is empty or torn). Only this writer
        publishes its rank's headers, so it remembers what it published instead of parsing each header's
        JSON (tens of KB for a deep model) on every save; others only remove headers (a restore's
        forgetting, a discard), which a stat sees."""
        if slot not in self._generations or not self.paths.slot(self.rank, slot, "json").exists():
            return -1
        return self._generations[slot]

    def _header(self, fields: dict[str, Any], entries: list[dict[str, Any]], mappings: dict[str, Any]) -> bytes:
        """The slot header as JSON: ``fields``, then the entry table and the mappings. Those two are
        encoded again only when they changed (the entries are the layout's own list while it holds):
        at 880 tensors they are ~6 ms of JSON on a slow CPU, on this thread, holding the GIL."""
        if self._encoded is None or self._encoded[0] is not entries or self._encoded[1] != mappings:
            tail = json.dumps({"entries": entries, "mappings": {k: list(v) for k, v in mappings.items()}})
            self._encoded = (entries, dict(mappings), tail[1:])
        return (json.dumps(fields)[:-1] + ", " + self._encoded[2]).encode()

    def _issue_cuda_copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], pinned: bool, ready: Any) -> None:
        """On the background thread: the device tensors' (destination, source) copies on the side
        stream, after ``ready``."""
        stream = self._stream
        with torch.no_grad(), torch.cuda.device(stream.device), torch.cuda.stream(stream):
            stream.wait_event(ready)
            copy_tensors([d for d, _ in pairs], [src for _, src in pairs], non_blocking=pinned)
            done = torch.cuda.Event()
            done.record(stream)
        self._cuda_event = done  # before ``_copied`` is set: wait_copied then orders the training stream after it

    # -- background thread -----------------------------------------------------------------------
    def _run(
        self,
        step: int,
        slot: int,
        entries: list[dict[str, Any]],
        size: int,
        captured: Captured,
        persist: bool,
        ready: Any,
        captured_at: float,
    ) -> None:
        s = self.slots[slot]
        t0 = time.perf_counter()
        try:
            pairs = [(dst, captured.sources[e["key"]]) for e, dst in zip(entries, s.views(entries))]
            if ready is not None:
                self._issue_cuda_copies([(d, src) for d, src in pairs if src.is_cuda], s.pinned, ready)
            with torch.no_grad():
                half = len(pairs) // 2
                for i, (dst, src) in enumerate(pairs):
                    if i == half and (fault := chaos.due("copy", step=step, rank=self.rank)):
                        fault.fire()
                    if not src.is_cuda:
                        dst.copy_(src)
            self._copied.set()
            if ready is not None:
                self._cuda_event.synchronize()
            self.stats["copy_s"] += time.perf_counter() - t0
            import io

            buf = io.BytesIO()
            torch.save((captured.objects, captured.groups), buf)
            blob = buf.getvalue()
            atomic_write(self.paths.slot(self.rank, slot, "obj"), blob)
            self.generation += 1
            fields = {
                "format": FORMAT,
                "rank": self.rank,
                "world_size": self.world_size,
                "step": step,
                "generation": self.generation,
                "persist": persist,
                "time": time.time(),
                "captured": captured_at,  # when the step's state was taken (``time``: when it was published)
                "epoch": self.epoch,  # the execution that took it (``runtime.ENV_EPOCH``)
                "restores": self.restores,
                "data_bytes": size,
                "objects_crc32": zlib.crc32(blob),
            }
            atomic_write(self.paths.slot(self.rank, slot, "json"), self._header(fields, entries, captured.mappings))
            self._generations[slot] = self.generation
            self.latest_slot = slot
            self.stats["snapshots"] += 1
            self.stats["last_step"] = step
        finally:
            self._copied.set()
            s.unlock()

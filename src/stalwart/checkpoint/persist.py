"""Tier 2 (docs/checkpoint.md "Tier 2: persistence"): write every rank's memory snapshot as one DCP
checkpoint, running DCP's own save protocol for all ranks at once from shared memory, so plain ``dcp.load``
reads and reshards it. Commit: shards fsynced → ``.metadata`` (tmp + rename) → directory fsynced →
manifest (each file's size and CRC32) → ``latest``; a crash before the last leaves the previous ``latest``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time
import zlib
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from stalwart import chaos
from stalwart._compat import checkpoint_writer, join_checkpoint_writer_threads
from stalwart.checkpoint.slot_file import dtype_named
from stalwart.checkpoint.snapshot import SnapshotView
from stalwart.checkpoint.storage import MANIFEST, METADATA, Storage, file_crc32, fsync_dir, step_name

log = logging.getLogger("stalwart.checkpoint")
FORMAT = "stalwart-ckpt/1"


class _SnapshotPlanner(DefaultSavePlanner):
    """DCP's default planner, fed from a snapshot's entry table instead of a live state dict."""

    def __init__(self, view: SnapshotView, share_equal_objects: bool = False) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self.view = view
        self.share = share_equal_objects
        self.aliases: dict[str, str] = {}  # object key → key of an equal object whose stored bytes it shares
        self._bytes: dict[tuple[str, str], bytes] = {}

    def set_up_planner(self, state_dict: Any = None, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, e in self.view.entries.items():
            offsets = torch.Size(e["chunk_offsets"])
            items.append(
                WriteItem(
                    index=MetadataIndex(key, offsets),
                    type=WriteItemType[e["item"]],
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(e["shape"])),
                        properties=TensorProperties(dtype=dtype_named(e["dtype"])),
                        size=torch.Size(e["global_shape"]),
                    ),
                )
            )
        if self.share:  # hyperparameters repeat per parameter: write each distinct value once (see share_bytes)
            first: dict[tuple[str, str], str] = {}
            for key, obj in self.view.objects.items():
                if (memo := _memo_key(obj)) is not None and first.setdefault(memo, key) != key:
                    self.aliases[key] = first[memo]
        items += [
            WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
            for key in self.view.objects
            if key not in self.aliases
        ]
        self.plan = SavePlan(items, planner_data=self.view.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._serialized(self.view.objects[key]))
        return self.view.tensor(key)

    def _serialized(self, obj: Any) -> bytes:
        """``torch.save`` bytes of one object; a small plain value is serialized once per persist."""
        memo = _memo_key(obj)
        if memo is not None and memo in self._bytes:
            return self._bytes[memo]
        buf = io.BytesIO()
        torch.save(obj, buf)
        if memo is not None:
            self._bytes[memo] = buf.getvalue()
        return buf.getvalue()


def _memo_key(obj: Any) -> tuple[str, str] | None:
    """A small plain value's identity (``repr`` tells 1, 1.0 and True apart, equality does not), else None."""
    plain = (
        obj is None
        or isinstance(obj, (bool, int, float, str))
        or (isinstance(obj, tuple) and len(obj) <= 8 and all(isinstance(x, (bool, int, float)) for x in obj))
    )
    return (type(obj).__name__, repr(obj)) if plain and len(repr(obj)) <= 200 else None


def share_bytes(planners: list[_SnapshotPlanner], metadata: Any, results: list[list[Any]]) -> None:
    """Point every aliased object key at the bytes written for its equal representative (a metadata record
    of file, offset, length, so plain ``dcp.load`` reads it): a hyperparameter recurs for every parameter,
    and spelled out it made a persist of the debug model several hundred items longer."""
    written = {wr.index.fqn: wr for rank in results for wr in rank}
    for planner, rank_results in zip(planners, results):
        for key, rep in planner.aliases.items():
            if key not in written:
                metadata.state_dict_metadata.setdefault(key, BytesStorageMetadata())
                rank_results.append(dataclasses.replace(written[rep], index=MetadataIndex(key)))
                written[key] = rank_results[-1]


class _CrcStream:
    """A write stream that keeps a running CRC32 of what passes through it."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.crc, self.size = raw, 0, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self.raw.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class _CrcFileSystem:
    """Wraps a DCP FileSystem: records size and CRC32 of every file written through it."""

    def __init__(self, inner: Any, sums: dict[str, dict[str, int]], before_close: Callable[[str], None]) -> None:
        self.inner, self.sums, self.before_close = inner, sums, before_close

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        with self.inner.create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _CrcStream(raw)
            yield stream
            name = str(path).rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(".distcp"):  # .metadata is summed after its rename
                self.before_close(name)
                self.sums[name] = {"size": stream.size, "crc32": stream.crc}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _writer(storage: Storage, step: int, sums: dict[str, dict[str, int]], hook: Callable[[str], None]) -> Any:
    def wrap(fs: Any) -> _CrcFileSystem:
        return _CrcFileSystem(fs, sums, hook)

    if storage.local:  # two files per rank, written by two threads: CRC and zip framing overlap I/O
        return checkpoint_writer(
            storage.checkpoint_id(step), local=True, wrap_fs=wrap, sync_files=True, overwrite=True, thread_count=2
        )
    # object stores are durable at close(); fsync does not apply (DCP would fall back to os.sync())
    return checkpoint_writer(
        storage.checkpoint_id(step), local=False, wrap_fs=wrap, sync_files=False, overwrite=True, **storage.options
    )


@contextmanager
def torch_save_without_crc() -> Generator[None, None, None]:
    """DCP frames each tensor with ``torch.save``, whose zip writer computes its own CRC32 (~4 GB/s).
    The manifest already holds a CRC32 of every file, so the second one is skipped while we write."""
    import torch.serialization as ser

    before = ser.get_crc32_options()
    ser.set_crc32_options(False)
    try:
        yield
    finally:
        ser.set_crc32_options(before)


class PlanOnlyView:
    """What planning needs of a rank whose snapshot lives on another node: its :func:`plan_table`, no tensors."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.entries = {e["key"]: e for e in table["entries"]}
        self.objects = dict.fromkeys(table["objects"])
        self.mappings = {k: tuple(v) for k, v in table["mappings"].items()}


def plan_table(view: SnapshotView) -> dict[str, Any]:
    """The JSON-able part of a snapshot that the coordinator plans from."""
    return {
        "entries": list(view.entries.values()),
        "objects": list(view.objects),
        "mappings": {k: list(v) for k, v in view.mappings.items()},
    }


def plan_items(
    views: list[Any], share_equal_objects: bool = False
) -> tuple[list[_SnapshotPlanner], list[SavePlan], Any]:
    """DCP's planning of a save of every rank's snapshot at once: local plans, the global plan's
    de-duplication of replicated items (each kept by one rank) and the metadata a load plans from."""
    planners = [_SnapshotPlanner(v, share_equal_objects) for v in views]
    local_plans = []
    for rank, planner in enumerate(planners):
        planner.set_up_planner(is_coordinator=rank == 0)
        local_plans.append(planner.create_local_plan())
    plans, metadata = planners[0].create_global_plan(local_plans)
    return planners, plans, metadata


def global_plan(
    storage: Storage, step: int, views: list[Any], share_equal_objects: bool = False
) -> tuple[list[_SnapshotPlanner], list[SavePlan], Any]:
    """DCP's coordinator step for every rank at once (``views[r]`` real or plan-only): :func:`plan_items` and
    each rank's file prefix. ``share_equal_objects`` (real views only): call :func:`share_bytes` before commit."""
    planners, plans, metadata = plan_items(views, share_equal_objects)
    writer = _writer(storage, step, {}, lambda _: None)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    return planners, writer.prepare_global_plan(plans), metadata


def write_rank(
    storage: Storage,
    step: int,
    rank: int,
    planner: _SnapshotPlanner,
    plan: SavePlan,
    sums: dict[str, dict[str, int]],
    hook: Callable[[str], None],
) -> list[Any]:
    """Write one rank's share of the global plan (its shard files, fsynced) → DCP write results.
    Call it inside :func:`torch_save_without_crc` (process-global, so entered once around all threads)."""
    writer = _writer(storage, step, sums, hook)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    writer.prepare_local_plan(plan)  # creates the step directory
    return writer.write_data(planner.finish_plan(plan), planner).wait()


def commit(
    storage: Storage,
    step: int,
    metadata: Any,
    results: list[list[Any]],
    sums: dict[str, dict[str, int]],
    world: int,
    source: str,
    snapshot_time: float,
    t0: float,
) -> dict[str, Any]:
    """After every rank's shards are durable: ``.metadata`` → manifest with CRCs → ``latest``."""
    writer = _writer(storage, step, {}, lambda _: None)
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    writer.finish(metadata, results)
    nbytes = sum(s["size"] for s in sums.values())
    size, crc = file_crc32(storage.fs, storage.path(step_name(step), METADATA))
    sums[METADATA] = {"size": size, "crc32": crc}
    if storage.local:
        fsync_dir(storage.path(step_name(step)))
    manifest = {
        "format": FORMAT,
        "step": step,
        "world_size": world,
        "created": time.time(),
        "source": source,
        "bytes": nbytes,
        "files": dict(sorted(sums.items())),
        "write_s": round(time.perf_counter() - t0, 4),
        "snapshot_time": snapshot_time,
    }
    storage.write_atomic(json_bytes(manifest), step_name(step), MANIFEST)
    storage.set_latest(step)
    manifest["commit_s"] = time.perf_counter() - t0
    return manifest


def chaos_hook(step: int) -> Callable[[str], None]:
    """Fires a ``persist`` chaos fault after the first shard file: a torn checkpoint."""
    fired: list[str] = []

    def hook(name: str) -> None:
        if not fired and name.endswith(".distcp"):
            fired.append(name)
            if fault := chaos.due("persist", step=step):
                fault.fire()

    return hook


def write_checkpoint(storage: Storage, step: int, views: list[SnapshotView], source: str) -> dict[str, Any]:
    """Write and commit the snapshots of all ranks (``views[r]`` is rank r's) for ``step``."""
    assert [v.info.rank for v in views] == list(range(len(views))), "one view per rank, in rank order"
    assert all(v.step == step for v in views), "all views must hold the same step"
    t0 = time.perf_counter()
    storage.remove(step)  # a torn leftover of an earlier attempt at this step
    try:
        return _write_and_commit(storage, step, views, source, t0)
    except BaseException:
        # DCP's writer threads outlive a failed write_data: they read the shared-memory views that our
        # caller unmaps next (a SIGSEGV that silently ended the keeper), and write into the directory.
        if stray := join_checkpoint_writer_threads(120.0):
            log.error("DCP writer threads %s still running after a failed persist", stray)
        remove_torn(storage, step)  # a full disk must not stay full of failed attempts
        raise


def remove_torn(storage: Storage, step: int) -> bool:
    """Remove the directory of a failed attempt at ``step`` (never a committed one). Returns False when
    that fails too (storage unreachable): the keeper removes it later, and it is never resumed from."""
    try:
        storage.refresh()
        if step in storage.committed():
            return True
        storage.remove(step)
        return True
    except Exception as err:
        log.warning("could not remove the failed attempt %s: %r; it is removed later", step_name(step), err)
        return False


def _write_and_commit(storage: Storage, step: int, views: list[SnapshotView], source: str, t0: float) -> dict[str, Any]:
    sums: dict[str, dict[str, int]] = {}
    hook = chaos_hook(step)
    planners, plans, metadata = global_plan(storage, step, views, share_equal_objects=True)

    def write(rank: int) -> list[Any]:
        return write_rank(storage, step, rank, planners[rank], plans[rank], sums, hook)

    with torch_save_without_crc():
        if len(views) == 1:
            results = [write(0)]
        else:
            with ThreadPoolExecutor(min(4, len(views))) as pool:
                results = list(pool.map(write, range(len(views))))
    share_bytes(planners, metadata, results)
    return commit(
        storage, step, metadata, results, sums, len(views), source, max(v.info.header["time"] for v in views), t0
    )


def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1).encode()


def retention(storage: Storage, keep_last: int, keep_every: int) -> list[int]:
    """Delete the steps outside the policy (keep the newest ``keep_last`` committed, those divisible by
    ``keep_every`` (0: none) and ``latest``) and torn ones older than ``latest``; returns those removed."""
    storage.refresh()
    latest = storage.latest()
    committed = storage.committed()
    keep = set(committed[: max(1, keep_last)])
    if latest is not None:
        keep.add(latest)
    if keep_every > 0:
        keep |= {s for s in committed if s % keep_every == 0}
    removed = []
    for s in storage.steps():
        torn = s not in committed
        if s in keep or (torn and (latest is None or s > latest)):
            continue
        storage.remove(s)
        removed.append(s)
    return removed

"""Tier-2 storage layout through fsspec (local paths, ``s3://``, ...): ``DIR/latest`` is the commit
point; a ``DIR/step-N/`` is *committed* when its manifest exists and ``latest`` names it or a later
step, anything else is torn and never resumed from. See docs/checkpoint.md, "Tier 2: persistence".
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import zlib
from typing import Any

import fsspec
import torch
from fsspec.core import url_to_fs

from stalwart._compat import STORAGE_INFO_CLASS

LATEST = "latest"
MANIFEST = "stalwart.json"
METADATA = ".metadata"
STEP_RE = re.compile(r"^step-(\d{8,})$")
CHUNK = 8 << 20


def step_name(step: int) -> str:
    return f"step-{step:08d}"


class Storage:
    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        if not url:
            raise ValueError("checkpoint directory is empty; set checkpoint.dir (a path or an fsspec URL)")
        self.options = dict(options or {})
        self.fs, root = url_to_fs(url, **self.options)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        if self.local:
            url = os.path.abspath(url.removeprefix("file://"))
            root = url
        self.url, self.root = url, root.rstrip("/")

    # -- paths -----------------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def checkpoint_id(self, step: int) -> str:
        """What to pass to ``dcp.load(checkpoint_id=...)`` (a path, or a URL with its protocol)."""
        if self.local:
            return self.path(step_name(step))
        return self.url.rstrip("/") + "/" + step_name(step)

    def refresh(self) -> None:
        self.fs.invalidate_cache()  # s3fs caches listings; the keeper writes from another process

    # -- small files -----------------------------------------------------------------------------
    def read_text(self, *parts: str) -> str | None:
        try:
            with self.fs.open(self.path(*parts), "rb") as f:
                return f.read().decode()
        except (FileNotFoundError, OSError):
            return None

    def write_atomic(self, data: bytes, *parts: str) -> None:
        """Durable, all-or-nothing replace: tmp + fsync + rename + fsync(dir) locally; object stores
        publish a single PUT atomically."""
        target = self.path(*parts)
        if not self.local:
            with self.fs.open(target, "wb") as f:
                f.write(data)
            return
        tmp = f"{target}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        fsync_dir(os.path.dirname(target))

    # -- checkpoints -----------------------------------------------------------------------------
    def latest(self) -> int | None:
        text = self.read_text(LATEST)
        m = STEP_RE.match(text.strip()) if text else None
        return int(m.group(1)) if m else None

    def set_latest(self, step: int) -> None:
        self.write_atomic(step_name(step).encode(), LATEST)

    def steps(self) -> list[int]:
        """Every step directory, committed or not, ascending."""
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := STEP_RE.match(n)))

    def manifest(self, step: int) -> dict[str, Any] | None:
        text = self.read_text(step_name(step), MANIFEST)
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return None

    def committed(self) -> list[int]:
        """Committed steps, newest first (manifest present and not beyond ``latest``)."""
        self.refresh()
        latest = self.latest()
        return [s for s in reversed(self.steps()) if (latest is None or s <= latest) and self.manifest(s) is not None]

    def forget_after(self, step: int) -> list[int]:
        """A rollback to ``step``: delete every step directory newer than it and move ``latest`` back to
        the newest committed one left (call under the job's persist lock). Returns the deleted steps."""
        self.refresh()
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            self.remove(s)
        kept = self.committed()
        if newer and kept:
            self.set_latest(kept[0])
        elif newer:  # nothing committed at or before ``step`` is left: no ``latest`` at all
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(LATEST))
        return newer

    def remove_uncommitted(self, below: int | None = None) -> list[int]:
        """Remove the step directories without a manifest (a persist that died mid-write: never resumed
        from; call under the job's persist lock), only those before step ``below`` if given. Returns the
        removed steps."""
        committed = set(self.committed())
        torn = [s for s in self.steps() if s not in committed and (below is None or s < below)]
        for s in torn:
            self.remove(s)
        return torn

    def remove(self, step: int) -> None:
        try:
            self.fs.rm(self.path(step_name(step)), recursive=True)
        except FileNotFoundError:
            pass

    def verify(self, step: int, files: list[str] | None = None) -> list[str]:
        """Problems with a checkpoint's files (missing, wrong size, CRC mismatch); [] when sound."""
        manifest = self.manifest(step)
        if manifest is None:
            return [f"{step_name(step)}: no {MANIFEST} (torn or in-progress checkpoint)"]
        problems = []
        for name in files if files is not None else sorted(manifest["files"]):
            want = manifest["files"][name]
            path = self.path(step_name(step), name)
            try:
                size, crc = file_crc32(self.fs, path)
            except FileNotFoundError:
                problems.append(f"{step_name(step)}/{name}: missing")
                continue
            if size != want["size"]:
                problems.append(f"{step_name(step)}/{name}: size {size} != {want['size']} in the manifest")
            elif crc != want["crc32"]:
                problems.append(f"{step_name(step)}/{name}: CRC32 {crc:08x} != {want['crc32']:08x} (corrupt shard)")
        return problems

    def read_metadata(self, step: int) -> Any:
        with self.fs.open(self.path(step_name(step), METADATA), "rb") as f:
            return safe_load_metadata(f)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(fs: fsspec.AbstractFileSystem, path: str) -> tuple[int, int]:
    crc, size = 0, 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


# -- DCP metadata without arbitrary unpickling ------------------------------------------------------
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.serialization": {"_get_layout"},  # maps a layout name to torch.strided etc.
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    STORAGE_INFO_CLASS[0]: {STORAGE_INFO_CLASS[1]},  # each shard's storage record
    "torch": {"Size", "strided", "contiguous_format", "channels_last", "preserve_format", "sparse_coo"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "tuple", "list", "dict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not allowed")


def safe_load_metadata(f: Any) -> Any:
    """Unpickle a DCP ``.metadata`` allowing only DCP's metadata classes, torch sizes and dtypes: a
    checkpoint from shared or remote storage must not be able to run code."""
    return _MetadataUnpickler(f).load()

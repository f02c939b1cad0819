"""Every private PyTorch API stalwart relies on, in one place.

Supported torch range: see ``SUPPORTED_TORCH`` (pyproject.toml pins the tested bounds). Each
reach-in below has a test in ``tests/unit/test_compat.py`` that fails loudly when torch changes it,
so a torch upgrade breaks one module and one test file, not the agent or the checkpoint at run time.
Nothing outside this module imports a private torch name (``torch.*._x``) or patches a torch object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SUPPORTED_TORCH = ("2.11", "2.13")  # lowest and highest minor version tested

# --- elastic agent, launcher, process helpers (torch.distributed.elastic / launcher) ---------------


# --- end of elastic agent section -------------------------------------------------------------


# --- distributed checkpoint (torch.distributed.checkpoint) -----------------------------------------


# DCP's shard writers open every file through an internal ``fs`` object (``create_stream``); its
# flattening of nested state dicts, the fsspec reader/writer and the storage records of a shard are
# private modules/classes. Identical in torch 2.11 and 2.13 (checked with both), so no version branch.


def flatten_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]]:
    """DCP's own flattening (``_nested_dict.flatten_state_dict``): the keys ``dcp.save``/``dcp.load``
    derive from a nested dict, and each key's path in it. A checkpoint's keys must be exactly these."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict as flatten

    return flatten(state_dict)


def _fsspec_classes() -> tuple[type, type]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    return FsspecWriter, FsspecReader


def checkpoint_writer(path: str, *, local: bool, wrap_fs: Callable[[Any], Any], **kwargs: Any) -> Any:
    """A DCP ``FileSystemWriter`` (``local``) or ``FsspecWriter`` whose internal file system (the
    ``fs`` attribute through which ``write_data``/``finish`` open every stream) is ``wrap_fs(fs)``:
    stalwart sums each shard's bytes as they pass, instead of reading the files back."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    base = FileSystemWriter if local else _fsspec_classes()[0]
    writer = base(path, **kwargs)
    writer.fs = wrap_fs(writer.fs)
    return writer


def checkpoint_reader(path: str, *, local: bool, read_metadata: Callable[[], Any], **kwargs: Any) -> Any:
    """A DCP ``FileSystemReader`` (``local``) or ``FsspecReader`` that takes its ``.metadata`` from
    ``read_metadata()`` (stalwart's restricted unpickler) instead of ``pickle.load``; it stamps the
    reader's ``load_id`` on it as DCP's own ``read_metadata`` does."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    base = FileSystemReader if local else _fsspec_classes()[1]

    class _Reader(base):  # type: ignore[valid-type, misc]
        def read_metadata(self, *args: Any, **kw: Any) -> Any:
            md = read_metadata()
            if getattr(md, "storage_meta", None) is not None:
                md.storage_meta.load_id = self.load_id
            return md

    return _Reader(path, **kwargs)


def storage_info_fields(info: Any) -> dict[str, Any]:
    """The fields of a shard's storage record (``filesystem._StorageInfo``, a ``WriteResult``'s
    ``storage_data``) as JSON-able values, for sending write results between nodes."""
    return {"path": info.relative_path, "at": info.offset, "length": info.length,
            "transforms": list(info.transform_descriptors or []) or None}


def storage_info(fields: dict[str, Any]) -> Any:
    """The inverse of :func:`storage_info_fields`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(fields["path"], fields["at"], fields["length"], fields["transforms"])


def storage_prefix(prefix: str) -> Any:
    """A rank's file-name prefix in a global save plan (``filesystem._StoragePrefix``)."""
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    return _StoragePrefix(prefix)


# ``.metadata`` pickles storage records by this (module, class name): the restricted unpickler allows it.
STORAGE_INFO_CLASS = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


# --- end of distributed checkpoint section ----------------------------------------------------


# --- device mesh (torch.distributed.device_mesh) ---------------------------------------------


# --- end of device mesh section ---------------------------------------------------------------


# --- training (determinism, activation checkpointing) --------------------------------------------


# --- end of training section ------------------------------------------------------------------

"""One snapshot slot's data file as the writer holds it: opened once, grown with ``posix_fallocate`` (a
full /dev/shm fails before a copy, not with SIGBUS in it), mapped with every page populated, viewed as
one tensor per entry, page-locked for asynchronous device-to-host copies on CUDA."""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("stalwart.checkpoint")


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in snapshot header")
    return dtype


def entry_tensor(buf: Any, entry: dict[str, Any]) -> torch.Tensor:
    """A tensor over exactly this entry's bytes (its own storage, so ``torch.save`` writes only it)."""
    dtype, shape, nbytes = dtype_named(entry["dtype"]), entry["shape"], entry["nbytes"]
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=entry["offset"])
    return raw.view(dtype).view(shape)


def shm_free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class SlotFile:
    """One slot's data file, kept open and mapped by the writer for the life of the process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.size = 0
        self.map: mmap.mmap | None = None
        self.pinned = False
        self._views: tuple[list[dict[str, Any]], mmap.mmap | None, list[torch.Tensor]] | None = None

    def views(self, entries: list[dict[str, Any]]) -> list[torch.Tensor]:
        """A tensor over each entry's bytes in this slot, made once per layout and mapping, not per save."""
        if self._views is None or self._views[0] is not entries or self._views[1] is not self.map:
            self._views = (entries, self.map, [entry_tensor(self.map, e) for e in entries])
        return self._views[2]

    def try_lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def ensure(self, size: int) -> None:
        """Grow to ``size`` bytes (caller holds the exclusive lock). ``posix_fallocate`` reserves the
        tmpfs pages now, so a full /dev/shm fails here with ENOSPC instead of SIGBUS mid-copy."""
        current = os.fstat(self.fd).st_size
        if self.map is not None and self.size >= size:
            return
        if current < size:
            os.posix_fallocate(self.fd, 0, size)
        self.unpin()  # the old mapping goes: its page-locking must not outlive it
        self.size = max(size, current)
        # MAP_POPULATE maps every page now, so no copy pays page faults later.
        self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))

    def _address(self) -> int:
        import ctypes

        return ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def pin_for_cuda(self) -> None:
        """Page-lock the mapping so device-to-host copies can be asynchronous (CUDA only)."""
        if self.pinned or self.map is None:
            return
        err = torch.cuda.cudart().cudaHostRegister(self._address(), self.size, 0)
        self.pinned = int(err) == 0
        if not self.pinned:
            log.warning("cudaHostRegister of %s failed (%s); snapshot copies will be synchronous", self.path, err)

    def unpin(self) -> None:
        if self.pinned and self.map is not None:
            torch.cuda.cudart().cudaHostUnregister(self._address())
        self.pinned = False

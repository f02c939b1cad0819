"""Bitwise fingerprints of model/optimizer state, used by determinism and fault tests."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch


def _full(t: torch.Tensor) -> torch.Tensor:
    # DTensor (FSDP2/TP) → the whole tensor; every rank must call this together.
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def tensor_digest(t: torch.Tensor) -> str:
    t = _full(t).detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_dict_hash(state: Mapping[str, Any]) -> str:
    """SHA-256 over keys, dtypes, shapes and exact bytes of every tensor (nested dicts/lists too).

    Non-tensor leaves are hashed through repr, so step counters and hyper-parameters count as well.
    Keys are visited in sorted order: two states hash equal iff they are bitwise equal.
    """
    h = hashlib.sha256()

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key in sorted(value, key=str):
                visit(f"{prefix}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(f"{prefix}[{i}]", item)
        elif isinstance(value, torch.Tensor):
            h.update(f"{prefix}=tensor:{tensor_digest(value)};".encode())
        else:
            h.update(f"{prefix}={value!r};".encode())

    visit("", state)
    return h.hexdigest()

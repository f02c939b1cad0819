"""Bitwise fingerprints of model/optimizer state, used by determinism and fault tests."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist


def _full(t: torch.Tensor) -> torch.Tensor:
    # DTensor (FSDP2/TP) → the whole tensor; every rank must call this together.
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def tensor_digest(t: torch.Tensor) -> str:
    t = _full(t).detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _Digest(str):
    """A tensor already reduced to its digest; hashes exactly like the tensor it stands for."""


def _digested(value: Any) -> Any:
    """The same structure with every tensor replaced by its digest (small, picklable)."""
    if isinstance(value, Mapping):
        return {k: _digested(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_digested(v) for v in value)
    return _Digest(tensor_digest(value)) if isinstance(value, torch.Tensor) else value


def _merge(a: Any, b: Any, where: str = "") -> Any:
    """Union of two ranks' parts of one state: dicts by key, lists of dicts (optimizer param
    groups) element-wise, lists of names (a group's ``params``) concatenated; anything else must agree."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out = dict(a)
        for key, value in b.items():
            out[key] = _merge(a[key], value, f"{where}.{key}") if key in a else value
        return out
    if isinstance(a, list) and isinstance(b, list):
        if all(isinstance(x, str) for x in a + b):
            return a + [x for x in b if x not in a]
        if len(a) == len(b):
            return [_merge(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
    if a != b:
        raise ValueError(f"state parts disagree at {where or 'the root'}: {a!r} vs {b!r}")
    return a


def state_dict_hash(state: Mapping[str, Any], group: Any = None) -> str:
    """SHA-256 over keys, dtypes, shapes and exact bytes of every tensor (nested dicts/lists too).

    Non-tensor leaves are hashed through repr, so step counters and hyper-parameters count as well.
    Keys are visited in sorted order: two states hash equal iff they are bitwise equal.

    ``group``: ranks that each hold a different part of the state (pipeline stages): the parts are
    merged first, so every rank returns the hash of the whole (a collective over ``group``).
    """
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, _digested(state), group=group)
        state = parts[0]
        for part in parts[1:]:
            state = _merge(state, part)
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
        elif isinstance(value, _Digest):
            h.update(f"{prefix}=tensor:{value};".encode())
        else:
            h.update(f"{prefix}={value!r};".encode())

    visit("", state)
    return h.hexdigest()

"""Apply data parallelism from outside the model: DDP or FSDP2 (`fully_shard`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.config import ParallelConfig
from stalwart.dist import DistEnv


def apply_data_parallel(model: nn.Module, cfg: ParallelConfig, env: DistEnv) -> nn.Module:
    """DDP replicates; FSDP2 shards each block and then the root (ZeRO-3 when parameters are
    resharded after forward, ZeRO-2-like when they stay gathered until backward)."""
    if cfg.dp_mode == "ddp":
        ids = [env.device.index] if env.device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    assert cfg.dp_mode == "fsdp", cfg.dp_mode
    for block in model.layers.values():
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module behind a DDP wrapper (FSDP2 modifies the module in place)."""
    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce/reduce-scatter on all but the last micro-batch."""
    if isinstance(model, DDP) and not enabled:
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    else:
        yield


def grad_norm_clip(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm (clipped when max_norm > 0), as a plain tensor on every rank."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm

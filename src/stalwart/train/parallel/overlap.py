"""Communication/compute overlap, applied from outside the model (docs/techniques.md, "Overlap").

- FSDP2: explicit prefetch of the next ``depth`` blocks' all-gathers, in forward (block i issues
  blocks i+1..i+depth's all-gathers before its own compute) and backward (block i issues i-1..i-depth).
  ``depth = 0`` leaves FSDP2's implicit prefetch alone, which overlaps only where the host runs ahead
  of the device (CUDA streams). Off CUDA, FSDP2 would still issue a prefetched all-gather synchronously
  (``async_op=False``), so there the unshards are made asynchronous too: the gloo all-gather then runs
  on gloo's threads while the main thread computes, and the next block waits for it.
- DDP: gradient buckets of ``ddp_bucket_mb`` are all-reduced as soon as they are full, during the
  backward (one bucket as large as the model = no overlap: its all-reduce starts after the backward).
- TP: async TP (micro-pipelined all-gather/reduce-scatter matmuls) is an inductor pass over compiled
  blocks with symmetric memory on CUDA; there is nothing of it on the CPU, so asking for it there is
  an error rather than a silent no-op.
- PP: torch.distributed.pipelining's schedules already post their sends asynchronously (see the
  docs), so stalwart adds no option there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from stalwart import _compat


def check_fsdp_prefetch(depth: int) -> None:
    if depth < 0:
        raise ValueError(f"parallel.fsdp_prefetch must be ≥ 0 (0 = FSDP2's implicit prefetch only), got {depth}")


def check_ddp_bucket_mb(mb: float) -> None:
    if not mb > 0:
        raise ValueError(f"parallel.ddp_bucket_mb must be positive (MB per gradient bucket), got {mb}")


def set_fsdp_prefetch(blocks: list[nn.Module], depth: int) -> None:
    """Make each FSDP2 block prefetch the all-gathers of the next ``depth`` blocks (forward order) and
    of the ``depth`` blocks before it (backward order). ``depth = 0``: FSDP2's implicit prefetch."""
    check_fsdp_prefetch(depth)
    sharded = [b for b in blocks if isinstance(b, FSDPModule)]
    if depth == 0 or len(sharded) < 2:
        return
    for i, block in enumerate(sharded):
        ahead = sharded[i + 1 : i + 1 + depth]
        behind = sharded[max(0, i - depth) : i][::-1]  # backward runs last block first
        if ahead:
            block.set_modules_to_forward_prefetch(ahead)
        if behind:
            block.set_modules_to_backward_prefetch(behind)


def prefetch_fsdp(part: nn.Module, depth: int, device: torch.device) -> None:
    """Explicit prefetch over ``part``'s blocks; off CUDA also asynchronous unshards (see above)."""
    set_fsdp_prefetch(list(part.layers.values()), depth)
    if depth > 0 and device.type != "cuda":
        _compat.fsdp_async_unshard(part)


def check_async_tp(enabled: bool, tp: int, device: torch.device | None = None) -> None:
    """Async TP needs TP and CUDA (symmetric memory); say so instead of running without it."""
    if not enabled:
        return
    if tp < 2:
        raise ValueError("parallel.async_tp overlaps tensor-parallel collectives but tp = 1; set parallel.tp ≥ 2")
    if device is not None and device.type != "cuda":
        raise ValueError(
            f"parallel.async_tp needs CUDA (symmetric memory and an inductor pass); this run is on "
            f"{device.type}, where TP collectives are not overlapped: set parallel.async_tp = false"
        )


def enable_async_tp(tp_mesh: DeviceMesh, device: torch.device) -> None:
    """Turn on inductor's micro-pipelined TP for this TP group (takes effect in compiled blocks)."""
    check_async_tp(True, tp_mesh.size(), device)
    _compat.enable_async_tp(tp_mesh.get_group().group_name)

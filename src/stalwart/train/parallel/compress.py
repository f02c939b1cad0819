"""Gradient compression for data parallelism (survey: bf16/fp16 all-reduce, PowerSGD, ALQ).

DDP takes PyTorch's own communication hooks: ``bf16``/``fp16`` halve the all-reduce volume by
casting gradient buckets (and casting back, so the optimizer still sees fp32); ``powersgd`` sends a
rank-r low-rank approximation with error feedback (Vogels et al. 2019) after ``start_iter`` plain
steps; ``alq`` all-gathers stochastically rounded level indices on levels adapted to the gradients
(``alq.py``). FSDP2 has no comm hooks; ``bf16``/``fp16`` map to its reduce dtype instead, and PowerSGD
and ALQ are refused (they need the full gradient of a bucket on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from stalwart.train.parallel.alq import ALQState, alq_hook

MODES = ("none", "bf16", "fp16", "powersgd", "alq")


def check_mode(mode: str, uses_ddp: bool) -> None:
    if mode not in MODES:
        raise ValueError(f"compress={mode!r} is not one of {', '.join(MODES)}")
    if mode in ("powersgd", "alq") and not uses_ddp:
        raise ValueError(
            f"compress={mode!r} needs plain DDP (dp_replicate > 1 and no dp_shard/tp/pp/ep); "
            "with FSDP2 use compress='bf16' (reduce in bf16) or 'none'"
        )


def cast_hook(dtype: torch.dtype) -> Callable[..., torch.futures.Future]:
    """``default_hooks.{bf16,fp16}_compress_hook`` without their CUDA/NCCL-only check (torch's bf16
    hook refuses gloo although gloo all-reduces bf16): cast the bucket, pre-divide by the world,
    all-reduce, cast back into the bucket."""

    def hook(group, bucket):  # no annotations: DDP rejects string annotations of `bucket`
        pg = group if group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(pg))
        fut = dist.all_reduce(compressed, group=pg, async_op=True).get_future()

        def decompress(f):
            out = bucket.buffer()
            out.copy_(f.value()[0])
            return out

        return fut.then(decompress)

    return hook


def serialized(hook: Callable[..., torch.futures.Future]) -> Callable[..., torch.futures.Future]:
    """Run a multi-collective hook to completion before DDP hands it the next bucket. PowerSGD chains
    three all-reduces through future callbacks; on gloo, callbacks of different buckets then issue
    collectives in a different order on different ranks ("Received data size doesn't match")."""

    def run(state, bucket):
        fut = hook(state, bucket)
        fut.wait()
        return fut

    return run


def register(
    model: DDP,
    mode: str,
    *,
    powersgd_rank: int = 1,
    powersgd_start_iter: int = 2,
    alq_bits: int = 4,
    alq_update_every: int = 50,
    seed: int = 0,
) -> Any:
    """Register the hook for ``mode`` on a DDP model; returns the hook state (PowerSGD, ALQ) or None."""
    check_mode(mode, True)
    group = model.process_group
    if mode in ("bf16", "fp16"):
        model.register_comm_hook(group, cast_hook(torch.bfloat16 if mode == "bf16" else torch.float16))
    elif mode == "powersgd":
        if powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be ≥ 1, got {powersgd_rank}")
        if powersgd_start_iter < 2:
            raise ValueError(
                f"powersgd_start_iter must be ≥ 2 (error feedback needs one plain step), got {powersgd_start_iter}"
            )
        state = powersgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_iter,
            random_seed=seed,
        )
        hook = powersgd.powerSGD_hook
        if dist.get_backend(group) == "gloo":
            hook = serialized(hook)
        model.register_comm_hook(state, hook)
        return state
    if mode == "alq":
        alq = ALQState(group, bits=alq_bits, update_every=alq_update_every, seed=seed)
        model.register_comm_hook(alq, alq_hook)
        return alq
    return None


def fsdp_reduce_dtype(mode: str) -> torch.dtype | None:
    """FSDP2 reduce-scatter dtype standing in for the DDP compression hooks."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)

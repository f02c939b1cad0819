"""Process-group setup shared by the trainer and later tools.

One code path for every case: under a launcher (torchrun, `stalwart run`, `stalwart train --nproc`)
the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is used; a bare single process gets
a world of one over an in-memory store, so DDP/FSDP code need not special-case it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from stalwart.runtime import worker_env


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched() -> bool:
    """True when a launcher set up the torch.distributed environment variables (RANK and WORLD_SIZE)."""
    return worker_env().launched


def init_distributed(backend: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("parallel.backend='nccl' needs CUDA; use 'gloo' (or 'auto') on a CPU machine")
    env = worker_env()
    device = torch.device("cuda", env.local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if env.launched:
            dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(env.rank, env.world_size, env.local_rank, env.local_world_size, device, backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

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


def pick_device(backend: str, cuda_devices: int, local_rank: int, local_world_size: int) -> tuple[str, torch.device]:
    """(backend, device) for a rank. ``auto``: NCCL with a GPU per local rank; when ranks outnumber
    the GPUs they share them round-robin over gloo (NCCL refuses two ranks on one GPU: "Duplicate GPU
    detected"; gloo takes CUDA tensors); the CPU over gloo without CUDA. ``gloo`` always means the CPU."""
    use_cuda = cuda_devices > 0 and backend in ("auto", "nccl")
    if backend == "nccl" and not cuda_devices:
        raise ValueError("parallel.backend='nccl' needs CUDA; use 'gloo' (or 'auto') on a CPU machine")
    shared = use_cuda and local_world_size > cuda_devices
    if backend == "nccl" and shared:
        raise ValueError(
            f"parallel.backend='nccl' with {local_world_size} ranks on {cuda_devices} GPU(s): NCCL needs one "
            "GPU per rank; use 'auto' (ranks share the GPUs over gloo) or fewer ranks per node"
        )
    if backend == "auto":
        backend = "gloo" if shared or not use_cuda else "nccl"
    device = torch.device("cuda", local_rank % cuda_devices) if use_cuda else torch.device("cpu")
    return backend, device


def cuda_devices() -> int:
    """GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


PG_TIMEOUT_S = 600.0  # every process group of a job: a collective waits at most this long


def init_distributed(backend: str = "auto", timeout_s: float = PG_TIMEOUT_S) -> DistEnv:
    env = worker_env()
    backend, device = pick_device(backend, cuda_devices(), env.local_rank, env.local_world_size)
    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if env.launched:
            # device_id makes NCCL init eager, which lets DeviceMesh build each axis with one split_group
            # (ncclCommSplit) instead of one new_group per sub-group (docs/techniques.md, benchmarks/pg_init.py)
            dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistEnv(env.rank, env.world_size, env.local_rank, env.local_world_size, device, backend)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

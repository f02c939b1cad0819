"""pick_device: which backend and device a rank gets, for every GPU count (no GPU needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart.dist import pick_device
from stalwart.plan.parallel import Layout


@pytest.mark.parametrize(
    "backend, gpus, local_rank, local_world, expected",
    [
        ("auto", 0, 1, 2, ("gloo", torch.device("cpu"))),
        ("auto", 2, 1, 2, ("nccl", torch.device("cuda", 1))),  # a GPU per rank
        ("auto", 1, 1, 2, ("gloo", torch.device("cuda", 0))),  # two ranks share one GPU over gloo
        ("auto", 2, 3, 4, ("gloo", torch.device("cuda", 1))),  # round-robin
        ("gloo", 2, 1, 2, ("gloo", torch.device("cpu"))),  # gloo keeps its meaning: the CPU
        ("nccl", 1, 0, 1, ("nccl", torch.device("cuda", 0))),
    ],
)
def test_pick_device(backend, gpus, local_rank, local_world, expected):
    assert pick_device(backend, gpus, local_rank, local_world) == expected


def test_nccl_mistakes_are_actionable():
    with pytest.raises(ValueError, match="needs CUDA"):
        pick_device("nccl", 0, 0, 1)
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank"):
        pick_device("nccl", 1, 1, 2)


@pytest.mark.parametrize(
    "degrees, refused",
    [
        (dict(dp_shard=2), True),  # FSDP2
        (dict(tp=2), True),
        (dict(dp_shard=2, ep=2), True),
        (dict(dp_replicate=2, dp_shard=2), True),  # HSDP
        (dict(dp_replicate=2), False),  # DDP: plain collectives
        (dict(pp=2), False),  # PP alone: plain send/recv
        (dict(), False),
    ],
)
def test_dtensor_layouts_refuse_ranks_sharing_a_gpu_over_gloo(degrees, refused):
    """torch's functional all-gather over gloo on CUDA tensors dies with SIGSEGV (H100, torch 2.11)."""
    layout = Layout(**degrees)
    layout.check_device("gloo", "cpu")  # the CPU over gloo is fine
    layout.check_device("nccl", "cuda")  # a GPU per rank is fine
    if refused:
        with pytest.raises(ValueError, match="sharing a GPU over gloo is refused.*its own GPU"):
            layout.check_device("gloo", "cuda")
    else:
        layout.check_device("gloo", "cuda")


def test_stalwart_train_refuses_fsdp_on_a_shared_gpu_before_spawning(monkeypatch, tmp_path):
    """Two ranks on a one-GPU machine: `stalwart train --nproc 2 --parallel.dp_mode fsdp` says why and
    spawns nothing (a CUDA machine simulated: only the device count is asked)."""
    from stalwart.commands import train as train_cmd
    from stalwart.launch import local

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(local, "spawn_local", lambda *a, **k: pytest.fail("a worker was spawned"))
    overrides = {"parallel.dp_mode": "fsdp", "train.out_dir": str(tmp_path), "data.prepare_default": False}
    with pytest.raises(ValueError, match=r"dp_shard=2 with ranks sharing a GPU over gloo is refused"):
        train_cmd.train(Path("configs/debug.toml"), overrides, nproc=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a GPU per rank: NCCL, allowed

    class Spawned(Exception):
        pass

    def spawn(*args, **kwargs):
        raise Spawned

    monkeypatch.setattr(local, "spawn_local", spawn)
    with pytest.raises(Spawned):
        train_cmd.train(Path("configs/debug.toml"), overrides, nproc=2)

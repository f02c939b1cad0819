"""pick_device: which backend and device a rank gets, for every GPU count (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from stalwart.dist import pick_device


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

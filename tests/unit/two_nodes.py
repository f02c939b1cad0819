"""Two "nodes" in one process for the checkpoint tests across nodes: each a node-local job directory in
/dev/shm holding one rank's snapshots."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

from stalwart.checkpoint.shm import JobPaths, atomic_write
from stalwart.checkpoint.snapshot import SnapshotWriter
from stalwart.checkpoint.state import TrainingState

WORLD = 2


def two_node_dirs():
    """Two node-local job directories; rank r's snapshots live on node r."""
    roots = [Path("/dev/shm") / f"stalwart-mn-{uuid.uuid4().hex[:8]}" for _ in range(WORLD)]
    paths = [JobPaths(r) for r in roots]
    for rank, p in enumerate(paths):
        p.root.mkdir(parents=True)
        atomic_write(p.job, f'{{"storage": "unused", "world_size": {WORLD}, "ranks": [{rank}]}}'.encode())
    yield paths
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)


@pytest.fixture
def nodes():
    yield from two_node_dirs()


def snapshot(paths: JobPaths, rank: int, steps: list[int], epoch: int = 0) -> nn.Module:
    """Rank ``rank`` trains a replicated model (same seed on every rank, like DDP) and snapshots ``steps``
    in execution ``epoch``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainingState({"model": model, "optim": opt}, rank)
    writer = SnapshotWriter(paths, rank, WORLD, epoch=epoch)
    for s in range(1, max(steps) + 1):
        torch.manual_seed(s)
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if s in steps:
            writer.start(s, state.capture(), persist=True)
            writer.wait()
    writer.close()
    return model

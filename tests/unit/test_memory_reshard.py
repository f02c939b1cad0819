"""A job that shrank restores from the old world's memory snapshots, resharded: three real gloo
processes train an FSDP2 model and snapshot it; one node dies (its keeper had pushed its copy to a
peer); two processes then restore — no storage at all — and hold bitwise the full model and optimizer
state the three had."""

from __future__ import annotations

from pathlib import Path

from stalwart.checkpoint.shm import JobPaths

from .gloo_ranks import run_ranks
from .test_replicas import node_dies_after_pushing, shm  # noqa: F401  (shm: a fixture)

COMMON = r"""
import json, os, sys, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from stalwart.checkpoint.shm import JobPaths
from stalwart.checkpoint.state import TrainingState
from stalwart.runtime.lifetime import exit_process
from stalwart.utils import state_dict_hash
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(int(sys.argv[1]))
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 6))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
state = TrainingState({"model": model, "optim": opt}, rank)

def full_hash():
    full = StateDictOptions(full_state_dict=True)
    optim = get_optimizer_state_dict(model, opt, options=full)
    return state_dict_hash({"model": get_model_state_dict(model, options=full), "optim": optim})

def finish():  # gloo's teardown after FSDP2's collectives can abort a finished process (-6)
    dist.barrier()
    exit_process(0)
"""

TRAIN = (
    COMMON
    + r"""
from stalwart.checkpoint.snapshot import SnapshotWriter
from tests.unit.test_replicas import train_snapshots
writer = SnapshotWriter(JobPaths(sys.argv[2 + rank]), rank, world)
train_snapshots(model, opt, state, writer, range(1, 4), seed_of=lambda step: 10 * step + rank)
print(json.dumps({"rank": rank, "hash": full_hash()}), flush=True)
finish()
"""
)

RESTORE = (
    COMMON
    + r"""
from stalwart.checkpoint.restore import restore_state
info = restore_state(state, JobPaths(sys.argv[2 + rank]), None, rank, world)
print(json.dumps({"rank": rank, "hash": full_hash(), "info": info.as_dict()}), flush=True)
finish()
"""
)


def run(tmp_path: Path, script: str, seed: int, roots: list[Path]) -> dict[int, dict]:
    path = tmp_path / f"worker{len(roots)}.py"
    path.write_text(script)
    return run_ranks(path, len(roots), [str(seed), *map(str, roots)])


def test_a_shrunk_fsdp2_job_restores_the_old_worlds_memory_resharded_bitwise(shm, tmp_path):  # noqa: F811
    a, b, c = (JobPaths(shm / f"job-node{n}") for n in "ABC")
    for p in (a, b, c):
        p.root.mkdir(mode=0o700)
    trained = run(tmp_path, TRAIN, 0, [a.root, b.root, c.root])  # ranks 0, 1, 2 on nodes A, B, C
    node_dies_after_pushing(b, 1, a)  # no spare: A and C go on as ranks 0 and 1
    restored = run(tmp_path, RESTORE, 1, [a.root, c.root])  # seed 1: not the trained weights
    for row in restored.values():
        info = row["info"]
        assert info["source"] == "memory" and info["step"] == 3, info
        assert "at 3 ranks, resharded to 2" in info["detail"], info
        # C's new rank reads rows of old rank 1 and the objects kept by old rank 0, whose only copies
        # are on A: each fetched once; A's new rank reads old ranks 0 and 1 on its own host
        assert "2 cop(ies) fetched" in info["detail"], info
        assert row["hash"] == trained[0]["hash"], "the full model and optimizer state differ"
    assert not (c.root / "fetched").exists()  # transfer files removed

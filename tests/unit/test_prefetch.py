"""Prefetch serves exactly the samples, in exactly the order, of reading in the step — through skips,
rollbacks and a checkpoint's resume — and a tensor-parallel group reads each batch once.

References are the sampler and dataset used directly (``next_batch`` + ``batch``), compared token for
token. The TP test runs two real processes over gloo on a real DeviceMesh.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from stalwart.data import BatchLoader, GlobalSampler, TokenDataset

SEQ, GLOBAL = 32, 8


def reference(data: Path, state: dict | None, rank: int, world: int, steps: int) -> list[np.ndarray]:
    sampler = GlobalSampler(len(TokenDataset(data, SEQ)), GLOBAL, seed=3, skip=[(20, 28)])
    if state:
        sampler.load_state_dict(state)
    ds = TokenDataset(data, SEQ)
    out = []
    for _ in range(steps):
        x, y = ds.batch(sampler.next_batch(rank, world))
        out.append(torch.cat([x, y[:, -1:]], 1).numpy())
    return out


def served(loader: BatchLoader, steps: int) -> list[np.ndarray]:
    out = []
    for _ in range(steps):
        x, y = loader.next()
        out.append(torch.cat([x, y[:, -1:]], 1).numpy())
    return out


def loader_for(data: Path, depth: int, rank: int = 0, world: int = 1) -> BatchLoader:
    ds = TokenDataset(data, SEQ)
    sampler = GlobalSampler(len(ds), GLOBAL, seed=3, skip=[(20, 28)])
    return BatchLoader(ds, sampler, rank, world, depth, torch.device("cpu"))


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_prefetch_serves_the_samples_and_order_of_reading_in_the_step(stdlib_data, depth, rank, world):
    loader = loader_for(stdlib_data, depth, rank, world)
    try:
        got = served(loader, 6)
    finally:
        loader.close()
    want = reference(stdlib_data, None, rank, world, 6)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert loader.sampler.consumed == 6 * GLOBAL + 8, "the skip range (20:28) was jumped over"


def test_the_checkpointed_state_holds_only_batches_taken_and_resume_serves_the_next(stdlib_data):
    loader = loader_for(stdlib_data, depth=3)
    try:
        served(loader, 4)
        state = loader.sampler.state_dict()  # what a checkpoint captures, with 3 batches read ahead
        continued = served(loader, 3)
    finally:
        loader.close()
    assert state["consumed"] == 4 * GLOBAL + 8, "read-ahead batches must not be in the sampler's state"
    resumed = loader_for(stdlib_data, depth=3)
    resumed.sampler.load_state_dict(state)
    try:
        again = served(resumed, 3)
    finally:
        resumed.close()
    assert all(np.array_equal(a, b) for a, b in zip(again, continued, strict=True))
    want = reference(stdlib_data, state, 0, 1, 3)
    assert all(np.array_equal(a, b) for a, b in zip(again, want, strict=True))


def test_a_rollback_and_a_skip_drop_the_batches_read_ahead(stdlib_data):
    """The guard's recovery: restore an earlier sampler state, then skip batches — in the same process,
    with batches of the abandoned future already queued."""
    loader = loader_for(stdlib_data, depth=2)
    try:
        served(loader, 2)
        early = loader.sampler.state_dict()
        served(loader, 3)
        loader.sampler.load_state_dict(early)
        loader.sampler.skip(2)
        got = served(loader, 3)
        state = loader.sampler.state_dict()
    finally:
        loader.close()
    ref = GlobalSampler(len(TokenDataset(stdlib_data, SEQ)), GLOBAL, seed=3, skip=[(20, 28)])
    ref.load_state_dict(early)
    ref.skip(2)
    ds = TokenDataset(stdlib_data, SEQ)
    for batch in got:
        x, y = ds.batch(ref.next_batch(0, 1))
        assert np.array_equal(batch, torch.cat([x, y[:, -1:]], 1).numpy())
    assert state == ref.state_dict()


def test_a_negative_depth_is_refused(stdlib_data):
    from stalwart.config import load_config

    with pytest.raises(ValueError, match="data.prefetch"):
        loader_for(stdlib_data, depth=-1)
    with pytest.raises(ValueError, match="data.prefetch"):
        load_config(None, {"data.prefetch": -1}).validate()


# -- a tensor-parallel group reads once ------------------------------------------------------------
class _Unreadable(TokenDataset):
    def rows(self, indices):  # a TP rank that is not its group's first must never read
        raise AssertionError("read on a rank that should receive the batch")


class _Failing(TokenDataset):
    def rows(self, indices):  # the group's reader meets an I/O error
        raise OSError("disk gone")


def _tp_worker(rank: int, data: str, init: str, out: str, depth: int) -> None:
    import torch.distributed as dist

    from stalwart.plan.parallel import Layout
    from stalwart.train.parallel import build_mesh
    from stalwart.train.parallel.mesh import tp_data_group

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group, src = tp_data_group(build_mesh(Layout(tp=2), "cpu"))
    ds = (TokenDataset if rank == 0 else _Unreadable)(data, SEQ)
    sampler = GlobalSampler(len(ds), GLOBAL, seed=3, skip=[(20, 28)])
    loader = BatchLoader(ds, sampler, 0, 1, depth, torch.device("cpu"), group, src)  # dp: one rank
    batches = served(loader, 5)
    loader.close()
    np.save(f"{out}/rank{rank}.npy", np.stack(batches))
    with open(f"{out}/rank{rank}.reads", "w") as f:
        f.write(str(loader.reads))
    # The reader's read fails: it still broadcasts (rows of -1), so every rank raises on that batch,
    # none waits in a broadcast that never comes or takes the next batch's rows for this one.
    dataset = (_Failing if rank == 0 else _Unreadable)(data, SEQ)
    failing = BatchLoader(dataset, sampler, 0, 1, 0, loader.device, group, src)
    try:
        served(failing, 1)
        raised = "nothing"
    except Exception as err:
        raised = type(err).__name__
    with open(f"{out}/rank{rank}.raised", "w") as f:
        f.write(raised)
    # A failed read that nobody takes (a rollback dropped it) raises nowhere: the next batch still pairs.
    again = BatchLoader(
        (TokenDataset if rank == 0 else _Unreadable)(data, SEQ), sampler, 0, 1, 0, loader.device, group, src
    )
    np.save(f"{out}/rank{rank}.after.npy", np.stack(served(again, 1)))
    dist.destroy_process_group()


def test_a_tp_group_reads_each_batch_once_and_every_rank_gets_the_tp1_batches(stdlib_data, tmp_path):
    import torch.multiprocessing as mp

    depth = 2
    init = f"file://{tmp_path}/store"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.start_processes(
        _tp_worker, args=(str(stdlib_data), init, str(tmp_path), depth), nprocs=2, start_method="spawn", join=False
    )
    deadline = time.monotonic() + 240
    while not ctx.join(5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the TP group hung (raised: {[(tmp_path / f'rank{r}.raised').exists() for r in (0, 1)]})")
    want = np.stack(reference(stdlib_data, None, 0, 1, 5))  # what a tp=1 run reads
    for rank in (0, 1):
        assert np.array_equal(np.load(tmp_path / f"rank{rank}.npy"), want), f"rank {rank}"
    # rank 0 read the 5 served batches plus the 2 already submitted ahead at close; rank 1 none
    assert [(tmp_path / f"rank{r}.reads").read_text() for r in (0, 1)] == [str(5 + depth), "0"]
    assert [(tmp_path / f"rank{r}.raised").read_text() for r in (0, 1)] == ["OSError", "RuntimeError"]
    after = [np.load(tmp_path / f"rank{r}.after.npy") for r in (0, 1)]
    assert np.array_equal(after[0], after[1]), "the ranks of one TP group trained on different tokens"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

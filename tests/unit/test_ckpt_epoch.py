"""The execution epoch under plain ``torchrun`` across nodes: each agent counts its own restarts, so after
one node's failure the nodes' counts differ (the failed node's agent counts a restart, a peer restarted
for the membership change counts none). The checkpointers agree on one epoch, larger than every earlier
execution's, or the decider never sees the new execution form and nothing more is persisted."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from .gloo_ranks import run_ranks

WORKER = r"""
import json, os, sys, torch.distributed as dist
# TorchElastic's per-node restart count, set per rank the way each node's agent would
os.environ["TORCHELASTIC_RESTART_COUNT"] = os.environ["TEST_RESTART_COUNTS"].split(",")[int(os.environ["RANK"])]
from stalwart.checkpoint import Checkpointer
dist.init_process_group("gloo")
rank = dist.get_rank()
ck = Checkpointer(sys.argv[1], shm_root=sys.argv[2 + rank], job_id="epochs", keeper=False)
job = json.loads((ck.paths.job).read_text())
print(json.dumps({"rank": rank, "epoch": ck.epoch, "job_epoch": job["epoch"], "header": ck.writer.epoch}), flush=True)
dist.destroy_process_group()
"""


@pytest.fixture
def node_shms():
    roots = [Path("/dev/shm") / f"stalwart-ep-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for r in roots:
        r.mkdir()
    yield roots
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)


def execution(script: Path, storage: Path, shms: list[Path], restarts: list[int], monkeypatch) -> list[int]:
    """One execution of a two-node job (a rank per node, each node its own tmpfs); each rank's epoch."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("STALWART_EPOCH", raising=False)
    monkeypatch.setenv("TEST_RESTART_COUNTS", ",".join(map(str, restarts)))
    rows = run_ranks(script, 2, [str(storage), *map(str, shms)])
    assert all(r["epoch"] == r["job_epoch"] == r["header"] for r in rows.values()), rows
    return [rows[r]["epoch"] for r in range(2)]


def test_nodes_whose_restart_counts_differ_agree_on_an_epoch_larger_than_every_earlier_one(
    node_shms, tmp_path, monkeypatch
):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    a, b, spare = node_shms
    storage = tmp_path / "ckpt"
    assert execution(script, storage, [a, b], [0, 0], monkeypatch) == [0, 0]
    # b's worker failed: b's agent counts a restart; a's restarts for the membership change, uncounted
    assert execution(script, storage, [a, b], [0, 1], monkeypatch) == [1, 1]
    # a's worker failed next: both count one now, yet this is the third execution
    assert execution(script, storage, [a, b], [1, 1], monkeypatch) == [2, 2]
    # b is lost and a spare (an empty tmpfs, its agent's count 0) takes its rank
    assert execution(script, storage, [a, spare], [1, 0], monkeypatch) == [3, 3]
    assert json.loads(next(spare.glob("*/*/job.json")).read_text())["epoch"] == 3

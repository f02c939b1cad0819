"""The agent's save-on-failure hook (``launch.failure_save``): on one node it leaves the save to a live
keeper (the restart does not wait) and saves itself without one; across nodes without a master every
node shares it leaves the save to the keepers (the decider is rank 0's keeper's); with one, it waits for
the decider's word (``test_decider_actor``)."""

from __future__ import annotations

import os
import time

import pytest

from stalwart.checkpoint import NodeJob, Storage
from stalwart.launch.failure_save import FailureSave

POLICY = {"persist_every_steps": 4}


@pytest.fixture
def job(tmp_path):
    node = NodeJob(tmp_path / "shm" / "job")
    node.attach()
    return node


def _write(job: NodeJob, storage: Storage, world: int, ranks: list[int]) -> None:
    job.write_job(storage, world, ranks, POLICY, keeper=True, keeper_log=None)


def test_spans_nodes_when_job_json_lists_only_some_ranks(job, tmp_path):
    storage = Storage(str(tmp_path / "ck"))
    assert not job.spans_nodes()  # no job.json yet
    _write(job, storage, 2, [0, 1])
    assert not job.spans_nodes()
    _write(job, storage, 2, [0])
    assert job.spans_nodes()


def test_without_a_shared_master_the_restart_leaves_the_save_to_the_keepers(job, tmp_path, monkeypatch):
    """The decider is rank 0's keeper's (``desk_host``): the keepers save while the workers restart."""
    _write(job, Storage(str(tmp_path / "ck")), 2, [0])
    t0 = time.monotonic()
    result = FailureSave(job)(object())
    assert result["persisted"] is None and "keepers save on failure" in result["detail"], result
    assert time.monotonic() - t0 < 1.0 and not (tmp_path / "ck" / ".stage").exists()


@pytest.mark.parametrize("keeper_runs", [True, False])
def test_on_one_node_a_live_keeper_saves_and_else_the_agent_itself(job, tmp_path, keeper_runs):
    _write(job, Storage(str(tmp_path / "ck")), 1, [0])
    keeper = job.try_lock(job.paths.keeper_lock) if keeper_runs else None  # a live keeper holds it
    assert job.keeper_alive() == keeper_runs
    try:
        result = FailureSave(job)(object())  # an incident
    finally:
        if keeper is not None:
            os.close(keeper)
    if keeper_runs:
        assert result == {"persisted": False, "detail": "the node's keeper saves on failure"}
    else:  # it ran the save itself (nothing to save here: no snapshots were taken)
        assert result["persisted"] is False and "no snapshots under" in result["detail"], result

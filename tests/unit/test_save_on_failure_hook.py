"""The agent's save-on-failure hook: on one node it leaves the save to a live keeper (the restart does
not wait); across nodes the agent on rank 0's node saves itself before it rejoins, since a busy keeper
can miss the death once the restarted worker replaces its owner record (the two-node race)."""

from __future__ import annotations

import os

import pytest

from stalwart.checkpoint import NodeJob, Storage
from stalwart.launch.run import _save_on_failure

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


@pytest.mark.parametrize(("world", "waits"), [(1, False), (2, True)])
def test_agent_saves_itself_across_nodes_even_with_a_live_keeper(job, tmp_path, world, waits):
    _write(job, Storage(str(tmp_path / "ck")), world, [0])
    keeper = job.try_lock(job.paths.keeper_lock)  # a live keeper holds it
    assert keeper is not None and job.keeper_alive()
    try:
        result = _save_on_failure(job)(object())  # an incident
    finally:
        os.close(keeper)
    if waits:  # it ran the save itself (nothing to save here: no snapshots were taken)
        assert result["persisted"] is False and "no snapshots under" in result["detail"], result
    else:
        assert result == {"persisted": False, "detail": "the node's keeper saves on failure"}

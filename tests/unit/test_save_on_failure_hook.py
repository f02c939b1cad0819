"""The agent's save-on-failure hook (``launch.failure_save``): on one node it leaves the save to a live
keeper (the restart does not wait); across nodes the agent on rank 0's node saves itself, since a busy
keeper can miss the death once the restarted worker replaces its owner record (the two-node race) — and
holds the restart only until every node has pinned the step, not for the whole commit."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

from stalwart.checkpoint import NodeJob, Storage, multinode, stage
from stalwart.checkpoint.shm import atomic_write, complete_slots
from stalwart.launch.failure_save import FailureSave
from stalwart.runtime import ENV_CKPT_DECIDER
from tests.unit import test_ckpt_multinode
from tests.unit.test_ckpt_multinode import WORLD, snapshot

nodes = test_ckpt_multinode.nodes  # the fixture: two node-local job directories

POLICY = {"persist_every_steps": 4}


@pytest.fixture(autouse=True)
def stage_protocol(monkeypatch):
    """The `.stage/` protocol's hook: it runs only under ``STALWART_CKPT_DECIDER=shadow`` now."""
    monkeypatch.setenv(ENV_CKPT_DECIDER, "shadow")


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
    monkeypatch.delenv(ENV_CKPT_DECIDER)
    _write(job, Storage(str(tmp_path / "ck")), 2, [0])
    t0 = time.monotonic()
    result = FailureSave(job)(object())
    assert result["persisted"] is None and "keepers save on failure" in result["detail"], result
    assert time.monotonic() - t0 < 1.0 and not (tmp_path / "ck" / ".stage").exists()


@pytest.mark.parametrize(("world", "waits"), [(1, False), (2, True)])
def test_agent_saves_itself_across_nodes_even_with_a_live_keeper(job, tmp_path, world, waits):
    _write(job, Storage(str(tmp_path / "ck")), world, [0])
    keeper = job.try_lock(job.paths.keeper_lock)  # a live keeper holds it
    assert keeper is not None and job.keeper_alive()
    try:
        result = FailureSave(job)(object())  # an incident
    finally:
        os.close(keeper)
    if waits:  # it ran the save itself (nothing to save here: no snapshots were taken)
        assert result["persisted"] is False and "no snapshots under" in result["detail"], result
    else:
        assert result == {"persisted": False, "detail": "the node's keeper saves on failure"}


def _two_node_job(nodes, storage: Storage, steps: dict[int, list[int]]) -> None:
    for rank, held in steps.items():
        snapshot(nodes[rank], rank, held)
        job = {"storage": storage.url, "world_size": WORLD, "ranks": [rank], "policy": POLICY}
        atomic_write(nodes[rank].job, json.dumps(job).encode())
        atomic_write(nodes[rank].owner(rank), json.dumps({"pid": 1, "rank": rank, "world_size": WORLD}).encode())


@contextlib.contextmanager
def keeper_of_node_1(nodes, storage: Storage) -> Iterator[dict[int, object]]:
    """Rank 1's node's keeper, while in the block: it takes part in each step rank 0's node asks for;
    yields what each of its persists gave (manifest or exception) by step."""
    out: dict[int, object] = {}
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            step = stage.requested_step(storage)
            if step is None or step in out:
                time.sleep(0.01)
                storage.refresh()
                continue
            try:
                out[step] = NodeJob(nodes[1].root).persist_step(storage, step, WORLD, "keeper", ranks=[1])
            except Exception as err:
                out[step] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join(60)


def test_across_nodes_the_restart_waits_only_until_every_node_pinned_the_step(nodes, tmp_path, monkeypatch):
    """The 2-node demo recovered ~1.4 s slower than one node: rank 0's node's agent committed the step
    before it rejoined. Now it returns once every node holds the step pinned; the restarted rank 0 then
    snapshots steps 9 and 10 into its other slot, and step 8 is committed intact behind them."""
    storage = Storage(str(tmp_path / "ckpt"))
    _two_node_job(nodes, storage, {0: [7, 8], 1: [7, 8]})
    slow, write_rank = 1.5, multinode.write_rank

    def slow_write(*args: object, **kwargs: object) -> object:
        time.sleep(slow)  # shards take their time: the commit comes well after the pin
        return write_rank(*args, **kwargs)

    monkeypatch.setattr(multinode, "write_rank", slow_write)
    hook = FailureSave(NodeJob(nodes[0].root))
    with keeper_of_node_1(nodes, storage) as participant:
        t0 = time.monotonic()
        said = hook(object())  # an incident: the workers were stopped
        returned_after = time.monotonic() - t0
        try:
            assert said["persisted"] is None and said["step"] == 8 and "pinned" in said["detail"], said
            assert returned_after < slow and storage.committed() == [], "the restart did not wait for the commit"
            snapshot(nodes[0], 0, [9, 10])  # the restarted rank 0 trains on: its writer takes the free slot
            assert sorted(s.step for s in complete_slots(nodes[0], 0)) == [8, 10]
        finally:
            hook.wait(60)
    assert storage.committed() == [8] and storage.verify(8) == [], storage.committed()
    assert isinstance(participant[8], dict), participant


def test_across_nodes_a_step_missing_on_another_node_holds_the_restart_until_an_older_one_is_pinned(nodes, tmp_path):
    """Rank 1 never held step 8 (it died copying it): no node pins 8, so the restart waits while the save
    turns to step 7 — until every node holds 7 pinned."""
    storage = Storage(str(tmp_path / "ckpt"))
    _two_node_job(nodes, storage, {0: [7, 8], 1: [7]})
    hook = FailureSave(NodeJob(nodes[0].root))
    with keeper_of_node_1(nodes, storage) as participant:
        said = hook(object())
        assert isinstance(participant[8], LookupError), "rank 1's node answered that it lacks step 8"
        hook.wait(60)
    assert said["persisted"] is None and said["step"] == 7, said
    assert storage.committed() == [7] and isinstance(participant[7], dict)

"""Rank 0's keeper hosts the checkpoint decider where no master every node shares exists; the other
keepers find it in the workers' rendezvous store (a real TCPStore, a real HTTP desk)."""

from __future__ import annotations

import json
import time

import pytest
from torch.distributed import TCPStore

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint import decider_wire as wire
from stalwart.checkpoint.desk_host import STORE_KEY, DeskHost
from stalwart.checkpoint.shm import JobPaths
from stalwart.runtime.master_call import MasterError, call_master


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return server, {"store": f"127.0.0.1:{server.port}"}


def member(desk, node: str, ranks: list[int], after: int | None = None) -> dict:
    event = {"kind": "Member", "epoch": 0, "ranks": ranks, "world": 2}
    return call_master(desk.address, desk.token, "POST", "/v1/ckpt", {"node": node, "events": [event], "after": after})


def tell(desk, node: str, *events) -> dict:
    body = {"node": node, "events": [wire.to_json(e) for e in events], "after": None}
    return call_master(desk.address, desk.token, "POST", "/v1/ckpt", body)


def test_rank0s_keeper_hosts_the_decider_and_the_others_find_it_in_the_store(tmp_path, store):
    server, job = store
    host, other = DeskHost(JobPaths(tmp_path / "n0")), DeskHost(JobPaths(tmp_path / "n1"))
    (tmp_path / "n0").mkdir()
    try:
        assert other.members(job, coordinator=False) is None, "nothing published yet"
        mine = host.members(job, coordinator=True)
        assert mine is not None and mine.address.startswith("http://127.0.0.1:")
        assert json.loads(server.get(STORE_KEY))["address"] == mine.address
        assert oct((tmp_path / "n0" / "desk.sqlite").stat().st_mode & 0o777) == "0o600", "the journal is private"
        time.sleep(0.15)  # the others look at most every LOOK_EVERY_S
        found = other.members(job, coordinator=False)
        assert found is not None and (found.address, found.token) == (mine.address, mine.token)
        assert found.me != mine.me, "two nodes on one host keep apart by their job directories"
        with pytest.raises(MasterError) as refused:
            call_master(mine.address, "wrong", "POST", "/v1/ckpt", {"node": "x", "events": []}, retry_for_s=0)
        assert refused.value.status == 403
        # The same desk as a job master's: both nodes' ranks form the execution.
        member(mine, mine.me, [0])
        reply = member(found, found.me, [1])
        assert reply["epoch"] == 0 and host.master.state.ckpt.decider.nodes == {mine.me: [0], found.me: [1]}
        assert host.master.state.ckpt.all_read(), "nothing decided yet: nothing to wait for"
    finally:
        host.close(wait_s=0)
        other.close()


def test_the_host_puts_its_address_into_a_restarts_new_store_and_waits_for_the_last_reads(tmp_path, store):
    _, job = store
    (tmp_path / "n0").mkdir()
    host = DeskHost(JobPaths(tmp_path / "n0"))
    mine = host.members(job, coordinator=True)
    assert mine is not None
    fresh = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the next round's store
    time.sleep(0.15)
    host.republish({"store": f"127.0.0.1:{fresh.port}"})
    assert json.loads(fresh.get(STORE_KEY))["address"] == mine.address
    # A node that has not read every decision holds the host's exit, for wait_s at most.
    member(mine, "a", [0])
    member(mine, "b", [1])
    assert host.master.state.ckpt.all_read()
    tell(mine, "a", ev.Holding("a", 1, 1, ((4, 0, (0,), True),)), ev.PersistDue(4, 0))
    tell(mine, "b", ev.Holding("b", 1, 1, ((4, 0, (1,), True),)))  # → Persist: b has it, a not yet
    assert host.master.state.ckpt.next > 1 and not host.master.state.ckpt.all_read()
    t0 = time.monotonic()
    host.close(wait_s=0.5)
    assert 0.45 < time.monotonic() - t0 < 3.0 and host.master is None


def test_the_master_decides_only_where_every_node_shares_it():
    from stalwart.checkpoint.desk_host import Membership
    from stalwart.runtime import ENV_JOB_TOKEN, ENV_MASTER, ENV_NODE_ID, ENV_SHARED_MASTER

    env = {ENV_MASTER: "http://127.0.0.1:9", ENV_JOB_TOKEN: "t", ENV_NODE_ID: "n0"}
    assert Membership.from_env({ENV_NODE_ID: "n0", ENV_SHARED_MASTER: "1"}) is None, "no master"
    assert Membership.from_env(env) is None, "a master of one node's own: rank 0's keeper's desk decides"
    shared = Membership.from_env({**env, ENV_SHARED_MASTER: "1"})
    assert shared is not None and (shared.address, shared.token, shared.me) == ("http://127.0.0.1:9", "t", "n0")


def test_a_keeper_finds_a_restarted_host_keepers_new_desk(tmp_path, store, monkeypatch):
    """The host keeper died and its successor listens elsewhere with a fresh token: the other keeper,
    whose calls now fail, reads the store again and reports to the new desk (else nothing across
    nodes would be persisted for the rest of the job)."""
    from stalwart.checkpoint.keeper import Keeper
    from stalwart.checkpoint.node_job import NodeJob
    from stalwart.runtime import ENV_SHARED_MASTER

    monkeypatch.delenv(ENV_SHARED_MASTER, raising=False)
    _, job = store
    jobs = []
    for rank in (0, 1):
        (tmp_path / f"n{rank}").mkdir()
        spec = {"storage": str(tmp_path / "ckpt"), "world_size": 2, "ranks": [rank], "store": job["store"]}
        (tmp_path / f"n{rank}" / "job.json").write_text(json.dumps(spec))
        jobs.append(NodeJob(tmp_path / f"n{rank}"))
    host, other = Keeper(jobs[0]), Keeper(jobs[1])
    try:
        host._find_decider()
        first = host.members.address
        deadline = time.monotonic() + 10
        while other.members is None and time.monotonic() < deadline:
            other._find_decider()
            time.sleep(0.02)
        assert other.members is not None and other.members.address == first
        other._find_decider()
        assert other.members.address == first, "linked and not failing: no look at the store"
        host.desk.close(wait_s=0)  # the host keeper dies ...
        host = Keeper(jobs[0])  # ... and the next one hosts a new desk
        host._find_decider()
        assert host.members.address != first
        other.actor.link.send()  # a call to the old desk fails
        deadline = time.monotonic() + 10
        while not other.actor.link.failing and time.monotonic() < deadline:
            time.sleep(0.02)
        deadline = time.monotonic() + 10  # the store is read again at most each second
        while other.members.address == first and time.monotonic() < deadline:
            other._find_decider()
            time.sleep(0.05)
        assert (other.members.address, other.members.token) == (host.members.address, host.members.token)
        assert other.status["decider"] == host.members.address
    finally:
        other.actor.link.close()
        host.desk.close(wait_s=0)

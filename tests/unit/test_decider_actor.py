"""Keepers acting on the decider (checkpoint/decider_actor.py, docs/protocol.md plan step 3): two nodes'
real snapshots, a real job master hosting the decider over HTTP, real storage — no `.stage/` file."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stalwart.checkpoint import NodeJob, Storage, plan_write
from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider_actor import Actor, await_restart, holdings
from stalwart.checkpoint.decider_link import DeciderLink
from stalwart.checkpoint.desk_host import Membership
from stalwart.launch.client import MasterClient
from stalwart.launch.master import Master
from tests.unit.two_nodes import WORLD, snapshot, two_node_dirs

NODES = {"n0": [0], "n1": [1]}


@pytest.fixture
def master(tmp_path):
    m = Master(tmp_path / "journal.sqlite", "token").start()
    for node, ranks in NODES.items():
        client = MasterClient(m.address, "token", retry_for_s=0)
        client.join(node, "host", 1)
        client.call(
            "POST",
            "/v1/ckpt",
            {"node": node, "events": [{"kind": "Member", "epoch": 0, "ranks": ranks, "world": WORLD}]},
        )
    yield m
    m.stop()


@pytest.fixture
def nodes():
    yield from two_node_dirs()


def actors(master, paths) -> list[Actor]:
    return [
        Actor(DeciderLink(master.address, "token", node, every_s=0.02), paths[r], lambda r=r: r == 0)
        for r, node in enumerate(NODES)
    ]


def tick(acts: list[Actor], paths, storage: Storage, outcomes: dict[str, list]) -> None:
    for actor, p in zip(acts, paths):
        steps = NodeJob(p.root).snapshot_steps(WORLD, NODES[actor.node])
        flagged = [s for s in next(iter(steps.values())) if all(h[s].get("persist") for h in steps.values())]
        actor.observe(steps, flagged)
        outcomes.setdefault(actor.node, []).extend(actor.act(storage, WORLD))


def until(what: str, done, acts, paths, storage, outcomes, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tick(acts, paths, storage, outcomes)
        if done():
            return
        time.sleep(0.02)
    raise AssertionError(f"no {what} within {timeout_s} s: {outcomes}")


def test_the_keepers_persist_a_due_step_as_the_decider_says_and_both_hear_the_commit(master, nodes, tmp_path):
    model = snapshot(nodes[0], 0, [3])
    snapshot(nodes[1], 1, [3])
    storage = Storage(str(tmp_path / "ckpt"))
    acts, outcomes = actors(master, nodes), {}
    try:
        until(
            "both nodes hearing the commit",
            lambda: all(any(o[:2] == ("committed", 3) for o in outcomes.get(n, ())) for n in NODES),
            acts,
            nodes,
            storage,
            outcomes,
        )
    finally:
        for a in acts:
            a.end(False, wait_s=0.5)
    assert storage.latest() == 3 and storage.verify(3) == [] and storage.manifest(3)["source"] == "keeper"
    assert master.state.ckpt.state()["latest"] == 3
    assert not (tmp_path / "ckpt" / ".stage").exists(), "no coordination file in storage"
    target = {f"model.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(target, checkpoint_id=storage.checkpoint_id(3), no_dist=True)
    assert all(torch.equal(target[f"model.{k}"], v) for k, v in model.state_dict().items())
    assert all(not a.views and a.plan is None for a in acts), "the plan's pins went with its release"


def test_a_failure_is_saved_as_the_decider_says_and_the_agent_hears_when_the_restart_may_proceed(
    master, nodes, tmp_path
):
    snapshot(nodes[0], 0, [2, 3])
    snapshot(nodes[1], 1, [2])  # rank 1 died copying step 3: only step 2 is held by every rank
    storage = Storage(str(tmp_path / "ckpt"))
    acts, outcomes, heard = actors(master, nodes), {}, {}
    members = Membership(master.address, "token", "n1")
    agent = threading.Thread(target=lambda: heard.update(await_restart(members, 0, lambda: storage, True, 20.0)))
    agent.start()
    try:
        for a, p in zip(acts, nodes):
            final = holdings(NodeJob(p.root).snapshot_steps(WORLD, NODES[a.node]))
            a.link.send(ev.WorkersGone(a.node, 0, final))
        until(
            "the save's commit", lambda: storage.latest() == 2 and not agent.is_alive(), acts, nodes, storage, outcomes
        )
    finally:
        agent.join(20)
        for a in acts:
            a.end(False, wait_s=0.5)
    assert heard == {"persisted": True, "step": 2, "detail": "the decider's save committed step 2"}
    assert storage.manifest(2)["source"] == "save-on-failure" and storage.verify(2) == []


def test_a_node_lost_during_the_persist_ends_it_and_the_survivor_unpins(master, nodes, tmp_path):
    snapshot(nodes[0], 0, [3])
    snapshot(nodes[1], 1, [3])
    storage = Storage(str(tmp_path / "ckpt"))
    n0, n1 = actors(master, nodes)
    outcomes: dict[str, list] = {}
    try:
        n1.observe(NodeJob(nodes[1].root).snapshot_steps(WORLD, [1]), [3])  # it reports, then never acts
        until("n0 pinned for the plan", lambda: n0.plan is not None, [n0], nodes[:1], storage, outcomes)
        master.state.presence_lost("n1")  # n1 never answered: its agent died
        until("the plan given up", lambda: n0.plan is None, [n0], nodes[:1], storage, outcomes)
    finally:
        n0.end(False, wait_s=0.5)
        n1.link.close()
    assert ("given-up", 3, "node n1 lost during the persist") in outcomes["n0"]
    assert storage.latest() is None and not n0.views
    assert not (tmp_path / "ckpt" / "step-00000003" / "p1").exists(), "the plan's tables went with it"


def test_a_plan_the_node_cannot_pin_in_full_is_refused_and_leaves_no_pin(nodes, tmp_path):
    snapshot(nodes[0], 0, [3])  # node n0 holds rank 0, but no copy of rank 1 the plan gives it
    storage = Storage(str(tmp_path / "ckpt"))
    actor = Actor(DeciderLink("http://127.0.0.1:9", "token", "n0"), nodes[0], lambda: True)

    def slot_fds() -> int:  # the link's thread may open a socket meanwhile: count the slots' files only
        return sum(str(nodes[0].root) in target for target in _fd_targets())

    fds = slot_fds()
    try:
        actor._take(ev.Persist(1, (3, 0), 1, ("n0",), 0, True, (("n0", (0, 1)),)), storage)
        (refusal,) = [e for _, e in actor.link._queue]
    finally:
        actor.link.close()
    assert refusal["kind"] == "Pinned" and not refusal["ok"] and "rank 1 no longer holds step 3" in refusal["reason"]
    assert actor.plan is None and not actor.views
    assert slot_fds() == fds, "rank 0's slot, opened first, was unpinned again"


def test_a_failed_write_is_told_to_the_keeper_and_retried_as_a_new_attempt(master, nodes, tmp_path, monkeypatch):
    snapshot(nodes[0], 0, [3])
    snapshot(nodes[1], 1, [3])
    storage = Storage(str(tmp_path / "ckpt"))
    real, failed = plan_write.write_share, []

    def full_disk_once(store, step, plan, attempt, world, views):
        if 1 in views and not failed:
            failed.append(attempt)
            raise OSError(28, "No space left on device")
        return real(store, step, plan, attempt, world, views)

    monkeypatch.setattr(plan_write, "write_share", full_disk_once)
    acts, outcomes = actors(master, nodes), {}
    try:
        until("the commit", lambda: storage.latest() == 3, acts, nodes, storage, outcomes)
    finally:
        for a in acts:
            a.end(False, wait_s=0.5)
    (bad,) = [o for o in outcomes["n1"] if o[0] == "failed"]  # the keeper's storage health counts it
    assert bad[1] == 3 and isinstance(bad[2], OSError) and failed == [1]
    named = {n for n in storage.manifest(3)["files"] if n.endswith(".distcp")}
    assert named and all(n.startswith("__p1a2_") for n in named), named


def _fd_targets() -> list[str]:
    """What this process's open file descriptors point at (one closed meanwhile is skipped)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out

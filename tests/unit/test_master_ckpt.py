"""The checkpoint decider hosted by a real job master: keepers' reports over authenticated HTTP, decisions
back, a lost node from the master's membership, its state through a master restart (issue 30, item 1)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint import decider_wire as wire
from stalwart.launch.client import MasterClient, MasterError
from stalwart.launch.master import Master

RANKS = {"n0": [0, 1], "n1": [2, 3]}


def started_master(tmp_path):
    """A real job master (journal in ``tmp_path``) that the nodes of ``RANKS`` joined."""
    m = Master(tmp_path / "journal.sqlite", "token").start()
    for node in RANKS:
        MasterClient(m.address, "token").join(node, "host", 2)
    yield m
    m.stop()


@pytest.fixture
def master(tmp_path):
    yield from started_master(tmp_path)


class Keeper:
    """One node's side of the exchange: sends events, reads the decisions numbered after its last read."""

    def __init__(self, master: Master, node: str) -> None:
        self.client, self.node, self.after = MasterClient(master.address, "token", retry_for_s=0), node, 0

    def send(self, *events) -> dict:
        body = {
            "node": self.node,
            "after": self.after,
            "events": [e if isinstance(e, dict) else wire.to_json(e) for e in events],
        }
        reply = self.client.call("POST", "/v1/ckpt", json.loads(json.dumps(body)))
        self.after = reply["next"] - 1
        reply["decisions"] = [wire.from_json(d, wire.DECISIONS) for d in reply["decisions"]]
        return reply

    def member(self, epoch: int = 0, agent: str = "") -> dict:
        report = {"kind": "Member", "epoch": epoch, "ranks": RANKS[self.node], "world": 4}
        return self.send({**report, "agent": agent} if agent else report)

    def holding(self, seq: int, *keys: tuple[int, int], pinned: bool = False) -> ev.Holding:
        return ev.Holding(self.node, 1, seq, tuple((s, e, tuple(RANKS[self.node]), pinned) for s, e in keys))


def formed(master: Master) -> tuple[Keeper, Keeper]:
    a, b = Keeper(master, "n0"), Keeper(master, "n1")
    assert a.member()["epoch"] is None, "one node's membership does not form the execution"
    assert a.send(a.holding(1, (4, 0)))["taken"] == 0, "a report before the execution formed is not taken"
    assert b.member()["epoch"] == 0
    return a, b


def persist_in_flight(master: Master) -> tuple[Keeper, Keeper, ev.Persist]:
    a, b = formed(master)
    a.send(a.holding(1, (4, 0)))
    b.send(b.holding(1, (4, 0)))
    (persist,) = a.send(ev.PersistDue(4, 0))["decisions"]
    assert persist == ev.Persist(1, (4, 0), 1, ("n0", "n1"), 0, False, (("n0", (0, 1)), ("n1", (2, 3))))
    assert b.send()["decisions"] == [persist], "every keeper reads the same decisions"
    return a, b, persist


def test_a_persist_is_planned_written_and_committed_through_the_master(master):
    a, b, plan = persist_in_flight(master)
    a.send(ev.Pinned("n0", plan.plan, True), ev.Wrote("n0", plan.plan, 1, True))
    write, commit = b.send(ev.Pinned("n1", plan.plan, True), ev.Wrote("n1", plan.plan, 1, True))["decisions"]
    assert write == ev.Write(plan.plan, (4, 0), 1, 0) and commit == ev.Commit(plan.plan, 4, 0)
    (release,) = a.send(ev.Committed(plan.plan, True))["decisions"][-1:]
    assert release == ev.Release(None, (4, 0), plan.plan, 0)
    assert master.state.ckpt.state()["latest"] == 4
    assert a.send()["decisions"] == [] and a.send()["missed"] is False, "nothing new, nothing missed"


def test_a_node_lost_during_a_persist_is_given_up_within_a_second_of_the_masters_record(master):
    a, _, plan = persist_in_flight(master)
    a.send(ev.Pinned("n0", plan.plan, True), ev.Wrote("n0", plan.plan, 1, True))
    master.state.presence_lost("n1")  # what the presence handler does when n1's agent dies
    lost_at = next(float(n["lost_at"]) for n in master.state.lost()["lost"] if n["node_id"] == "n1")
    decisions = a.send()["decisions"]
    seen = time.time()
    assert ev.GiveUp(plan.plan, 4, "node n1 lost during the persist", 0) in decisions
    assert seen - lost_at < 1.0, f"given up {seen - lost_at:.2f} s after the master's loss record"
    assert master.state.ckpt.state()["plan"] is None and master.state.ckpt.state()["lost"] == ["n1"]


def test_the_decider_and_its_decisions_survive_a_master_restart(master, tmp_path):
    a, b, plan = persist_in_flight(master)
    a.send(ev.Pinned("n0", plan.plan, True), ev.Wrote("n0", plan.plan, 1, True))
    master.stop()
    again = Master(tmp_path / "journal.sqlite", "token").start()
    try:
        b.client.address = again.address
        _, commit = b.send(ev.Pinned("n1", plan.plan, True), ev.Wrote("n1", plan.plan, 1, True))["decisions"]
        assert commit == ev.Commit(plan.plan, 4, 0), "n0's word from before the restart still counts"
        late = Keeper(again, "n0")  # a keeper that never read: every decision is still there, in order
        assert [type(d) for d in late.send()["decisions"]] == [ev.Persist, ev.Write, ev.Commit]
    finally:
        again.stop()


def test_a_new_epoch_forms_from_its_members_and_late_word_of_the_old_one_is_ignored(master):
    a, b, _ = persist_in_flight(master)
    a.member(epoch=1)
    assert master.state.ckpt.state()["epoch"] == 0, "half the world's members do not begin an epoch"
    b.member(epoch=1)
    assert master.state.ckpt.state()["epoch"] == 1
    assert a.member(epoch=0)["taken"] == 1 and master.state.ckpt.state()["epoch"] == 1
    a.send(ev.PersistDue(5, 0))  # a late flag of the old execution
    assert master.state.ckpt.state()["due"] is None


def test_a_new_launch_counting_epochs_from_0_again_gets_a_new_decider_and_the_old_ones_word_is_late(master):
    a, b = Keeper(master, "n0"), Keeper(master, "n1")
    a.member(0, "a1"), b.member(0, "a1b")
    a.member(1, "a1"), b.member(1, "a1b")
    assert master.state.ckpt.state()["epoch"] == 1
    a.send(a.holding(1, (4, 1))), b.send(b.holding(1, (4, 1)))
    a.send(ev.PersistDue(4, 1))
    assert master.state.ckpt.state()["plan"]["key"] == [4, 1]
    b.member(0, "a1b")  # the same launch's late word
    assert master.state.ckpt.state()["epoch"] == 1 and master.state.ckpt.state()["plan"] is not None
    a.member(0, "a2")  # requeued: a new agent, a new rendezvous from round 0
    assert master.state.ckpt.state() is None, "the last launch's decider is done"
    b.member(0, "a1b")  # a keeper of the last launch, still alive: not a member of this one
    assert master.state.ckpt.state() is None
    b.member(0, "a2b")
    state = master.state.ckpt.state()
    assert (state["epoch"], state["plan"], state["latest"]) == (0, None, None)
    b.member(1, "a1b")  # the old launch's agent again, with a round number the new one has not reached
    assert master.state.ckpt.state()["epoch"] == 0, "a lone report forms nothing"


def raw(master: Master, body: object, token: str | None = "token") -> tuple[int, str]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(f"{master.address}/v1/ckpt", json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["error"]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (
            {"node": "n0", "events": [{"kind": "Pinned", "node": "n1", "plan": 1, "ok": True}]},
            403,
            "reported for node n1",
        ),
        ({"node": "n0", "events": [{"kind": "NodeLost", "node": "n1", "epoch": 0}]}, 400, "not one of"),
        ({"node": "n0", "events": [{"kind": "PersistDue", "step": True, "epoch": 0}]}, 400, "PersistDue.step"),
        ({"node": "n0", "events": [{"kind": "PersistDue", "step": 5, "epoch": 0, "x": 1}]}, 400, "no field(s) ['x']"),
        ({"node": "n0", "events": [{"kind": "Wrote", "node": "n0", "plan": 1, "ok": True}]}, 400, "needs 'attempt'"),
        (
            {"node": "n0", "events": [{"kind": "Member", "epoch": 1, "ranks": [4], "world": 4}]},
            400,
            "ranks in [0, world)",
        ),
        ({"node": "", "events": []}, 400, "field 'node'"),
        ({"node": "n0", "after": "1"}, 400, "'after' must be an integer"),
    ],
)
def test_a_bad_report_is_refused_with_its_reason_and_changes_nothing(master, body, status, says):
    persist_in_flight(master)
    before = master.state.ckpt.state()
    valid = {"kind": "PersistDue", "step": 6, "epoch": 0}
    body = {**body, "events": [valid, *body.get("events", [])]} if "events" in body else body
    code, reason = raw(master, body)
    assert (code, says in reason) == (status, True), reason
    assert master.state.ckpt.state() == before, "a refused batch is refused whole"


def test_the_exchange_needs_the_job_token(master):
    assert raw(master, {"node": "n0"}, token=None)[0] == 401
    assert raw(master, {"node": "n0"}, token="wrong")[0] == 403
    with pytest.raises(MasterError, match="403"):
        MasterClient(master.address, "nope", retry_for_s=0).call("POST", "/v1/ckpt", {"node": "n0"})


@pytest.mark.parametrize(
    "message",
    [
        ev.Holding("a", 2, 9, ((3, 1, (0, 1), True), (2, 0, (), False))),
        ev.PersistDue(3, 1),
        ev.Pinned("a", 4, False, "not held"),
        ev.Wrote("a", 4, 2, True),
        ev.Committed(4, False, "disk full"),
        ev.WorkersGone("a", 1, ((3, 1, (0,), False),)),
        ev.Preempted(2),
        ev.JobEnded(),
        ev.Persist(4, (3, 1), 2, ("a", "b"), 1, True, (("a", (0,)), ("b", (1, 2)))),
        ev.Commit(4, 3, 1),
        ev.GiveUp(None, 3, "why", 1),
        ev.Release(None, None, 4, 1, True),
        ev.Release("a", (3, 1), 4, 1),
        ev.RestartMayProceed(1, None, "nothing held"),
    ],
)
def test_every_message_survives_the_wire(message):
    data = json.loads(json.dumps(wire.to_json(message)))
    assert wire.from_json(data, wire.FROM_KEEPERS + wire.DECISIONS) == message

"""Keepers' shadow reports to the decider in a real job master (docs/protocol.md, plan step 2): the
decider plans the step due once every rank holds it, the keepers answer from what storage got, and it
commits the step the old protocol committed — or gives up one the old protocol gave up."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider_link import DeciderLink
from stalwart.checkpoint.decider_shadow import Shadow, holdings

from .test_master_ckpt import RANKS, Keeper, started_master


@pytest.fixture
def master(tmp_path):
    yield from started_master(tmp_path)


def steps_of(node: str, *due: int, epoch: int = 0) -> dict:
    return {r: {s: {"epoch": epoch, "persist": True} for s in due} for r in RANKS[node]}


def until(what: str, done, shadows, given_up=frozenset(), timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for shadow in shadows:
            shadow.answer(-1, set(given_up))
        if result := done():
            return result
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s")


def test_holdings_name_each_snapshot_by_step_and_epoch():
    steps = {0: {4: {"epoch": 1}, 5: {"epoch": 1}}, 1: {4: {"epoch": 1}}}
    assert holdings(steps) == ((4, 1, (0, 1), False), (5, 1, (0,), False))


def test_the_decider_commits_the_step_storage_committed_and_gives_up_one_the_old_protocol_gave_up(master):
    for node in RANKS:
        Keeper(master, node).member()
    committed: set[int] = set()
    shadows = [
        Shadow(
            DeciderLink(master.address, "token", node, every_s=0.02), lambda n=node: n == "n0", committed.__contains__
        )
        for node in RANKS
    ]
    decider = master.state.ckpt.state
    try:
        for shadow, node in zip(shadows, RANKS):
            shadow.observe(steps_of(node, 4), [4])
        until("plan of step 4", lambda: (decider()["plan"] or {}).get("key") == [4, 0], shadows)
        until(
            "both pins (the old protocol may still be writing it)",
            lambda: sorted(decider()["plan"]["pinned"]) == ["n0", "n1"],
            shadows,
        )
        assert decider()["latest"] is None, "nothing is committed before storage has it"
        committed.add(4)  # the old protocol committed step 4
        until("the commit of step 4", lambda: decider()["latest"] == 4, shadows)

        for shadow, node in zip(shadows, RANKS):
            shadow.observe(steps_of(node, 8), [8])
        until(
            "step 8 given up",
            lambda: decider()["plan"] is None and decider()["due"] is None and decider()["next_plan"] == 3,
            shadows,
            given_up={8},
        )
        assert decider()["latest"] == 4
        for shadow in shadows:
            shadow.end(job_complete=True, last_persisted=4, given_up={8})
        outbox = [d for _, d in master.state.ckpt.outbox]
        assert [d["step"] for d in outbox if d["kind"] == "Commit"] == [4]
        [gave_up] = [d for d in outbox if d["kind"] == "GiveUp"]
        assert gave_up["step"] == 8 and gave_up["why"].endswith("(8, 0): given up by the old protocol"), gave_up
        assert decider()["ended"], "rank 0's node said the job ended"
    finally:
        for shadow in shadows:
            shadow.link.close()


def test_a_report_of_an_epoch_not_formed_yet_waits_to_be_sent_again(master):
    a, b = Keeper(master, "n0"), Keeper(master, "n1")
    a.member(), b.member()
    assert a.send(ev.PersistDue(6, 1))["taken"] == 0, "epoch 1 has not formed at the master"
    a.member(1), b.member(1)
    assert a.send(ev.PersistDue(6, 1))["taken"] == 1


def test_a_master_that_does_not_answer_costs_the_keeper_no_wait_and_loses_no_report():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    link = DeciderLink(f"http://127.0.0.1:{port}", "token", "n0", every_s=0.02)
    try:
        held = ((4, 0, (0, 1), False),)
        t0 = time.monotonic()
        link.send(ev.PersistDue(4, 0), ev.Holding("n0", 1, 1, ()), ev.Holding("n0", 1, 2, held))
        assert time.monotonic() - t0 < 0.5, "send never waits on the network"
        t0 = time.monotonic()
        assert not link.sync(10) and time.monotonic() - t0 < 5, "a failed call ends the wait at once"
        assert link.pending() == 2 and link.take() == [], "the newer holdings replace the older, nothing is lost"
    finally:
        link.close()


class OneNode:
    """What the shadow reads of a node's job: its execution and its snapshots."""

    def __init__(self, steps: dict) -> None:
        self.steps = steps

    def epoch(self) -> int:
        return 0

    def snapshot_steps(self, world: int, ranks: list[int]) -> dict:
        return {r: self.steps[r] for r in ranks}


def test_a_nodes_final_holdings_go_to_the_decider_once_every_worker_is_gone(master):
    for node in RANKS:
        Keeper(master, node).member()
    workers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in RANKS["n0"]]
    shadow = Shadow(DeciderLink(master.address, "token", "n0", every_s=0.02), lambda: True, lambda s: False)
    try:
        job, owners = OneNode(steps_of("n0", 4, 6)), {r: {"pid": w.pid} for r, w in zip(RANKS["n0"], workers)}
        workers[0].kill(), workers[0].wait()
        shadow.workers_died(job, 4, owners, {workers[0].pid})
        assert shadow.link.pending() == 0 and master.state.ckpt.state()["failure"] is None, "rank 1 still runs"
        workers[1].kill(), workers[1].wait()  # (SIGKILL: a test process may pass SIGTERM ignored on)
        shadow.workers_died(job, 4, owners, {workers[0].pid})
        assert shadow.link.sync(5)
        final = master.state.ckpt.state()["failure"]["final"]
        assert final == {"n0": {"4:0": [0, 1], "6:0": [0, 1]}}, final
    finally:
        for w in workers:
            w.kill()
        shadow.link.close()


def test_a_keeper_reports_no_membership_from_a_job_file_an_earlier_launch_left(master):
    from stalwart.checkpoint.membership import LostNodes

    members = LostNodes(master.address, "token", "n0", agent="launch-2")
    members.report_member(3, RANKS["n0"], 4, agent="launch-1")  # job.json of the last launch's workers
    assert master.state.ckpt.ranks_of("n0") == []
    members.report_member(0, RANKS["n0"], 4, agent="launch-2")
    assert master.state.ckpt.ranks_of("n0") == [0, 1]


def test_a_plan_pinned_while_the_old_protocol_wrote_is_refused_when_it_gives_the_step_up(master):
    for node in RANKS:
        Keeper(master, node).member()
    shadows = [
        Shadow(DeciderLink(master.address, "token", node, every_s=0.02), lambda n=node: n == "n0", lambda s: False)
        for node in RANKS
    ]
    decider = master.state.ckpt.state
    try:
        for shadow, node in zip(shadows, RANKS):
            shadow.observe(steps_of(node, 4), [4])
        until("both pins", lambda: sorted((decider()["plan"] or {}).get("pinned", [])) == ["n0", "n1"], shadows)
        # ... then the old protocol gives step 4 up (training outpaced it): the decider hears so
        until("step 4 given up", lambda: decider()["plan"] is None, shadows, given_up={4})
        [gave_up] = [d for _, d in master.state.ckpt.outbox if d["kind"] == "GiveUp"]
        assert gave_up["step"] == 4 and gave_up["why"].endswith("given up by the old protocol"), gave_up
    finally:
        for shadow in shadows:
            shadow.link.close()

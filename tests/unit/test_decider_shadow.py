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
from stalwart.checkpoint.decider_shadow import Shadow, holdings, pin_on_sight

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
    copies = {0: {5: {"epoch": 1}}, 3: {4: {"epoch": 1}}}  # peer copies: rank 3's counts, rank 0's twice once
    assert holdings(steps, {(5, 1)}, copies) == ((4, 1, (0, 1, 3), False), (5, 1, (0,), True))


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

    def copy_steps(self, world: int) -> dict:
        return {2: {4: {"epoch": 0}}}  # a peer copy of another node's rank


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
        assert final == {"n0": {"4:0": [0, 1, 2], "6:0": [0, 1]}}, final
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


def test_a_keeper_pins_a_due_step_on_sight_until_the_decider_releases_it(master, tmp_path):
    """The workers move on for several steps before the decider's plan comes back: the step due for
    persistence stays in memory, pinned (the writer takes the other slot), reported pinned, and is
    unpinned by the decider's Release once the plan ended."""
    import shutil
    import uuid
    from pathlib import Path

    import torch

    from stalwart.checkpoint.node_job import NodeJob
    from stalwart.checkpoint.snapshot import SnapshotWriter
    from stalwart.checkpoint.state import TrainingState

    for node in RANKS:
        Keeper(master, node).member()
    root = Path("/dev/shm") / f"stalwart-test-{uuid.uuid4().hex[:8]}"
    job = NodeJob(root)
    state = TrainingState({"model": torch.nn.Linear(4, 4)}, 0, rng=False)
    writers = {r: SnapshotWriter(job.paths, r, 4) for r in RANKS["n0"]}
    pin = lambda key, ranks: pin_on_sight(job.paths, key, ranks)
    committed: set[int] = set()
    shadows = [
        Shadow(DeciderLink(master.address, "token", n, every_s=0.02), lambda n=n: n == "n0", committed.__contains__, p)
        for n, p in (("n0", pin), ("n1", None))
    ]
    decider = master.state.ckpt.state

    def snapshot(step: int, ranks=RANKS["n0"]) -> None:
        for r in ranks:
            writers[r].start(step, state.capture(), persist=step % 4 == 0)
            writers[r].wait()

    def held_steps() -> set[int]:
        return set.intersection(*(set(v) for v in job.snapshot_steps(4, RANKS["n0"]).values()))

    try:
        snapshot(4, [0])
        shadows[0].observe(job.snapshot_steps(4, RANKS["n0"]), [])
        assert not shadows[0].sight, "pinned once every rank of the node holds it, not before"
        snapshot(4, [1])
        shadows[0].observe(job.snapshot_steps(4, RANKS["n0"]), [4])
        assert list(shadows[0].sight) == [(4, 0)]
        for step in (5, 6, 7):  # faster than any round trip to the decider
            snapshot(step)
        assert held_steps() == {4, 7}, "the pinned slot is kept, the other one reused"
        shadows[0].observe(job.snapshot_steps(4, RANKS["n0"]), [4])
        until("n0's pin reported", lambda: decider()["pins"]["n0"] == [[4, 0]], shadows)
        shadows[1].observe(steps_of("n1", 4, 7), [])
        until("plan of step 4", lambda: (decider()["plan"] or {}).get("key") == [4, 0], shadows)
        committed.add(4)
        until("the commit of step 4, and n0's pin released", lambda: not shadows[0].sight, shadows)
        assert decider()["latest"] == 4 and not any(
            "moved past" in d.get("why", "") for _, d in master.state.ckpt.outbox
        )
        shadows[0].observe(job.snapshot_steps(4, RANKS["n0"]), [4])
        assert not shadows[0].sight, "a released step is not pinned again while it is still in memory"
        snapshot(8)
        assert held_steps() == {7, 8}, "unpinned, the slot of step 4 is reused"
    finally:
        for shadow in shadows:
            shadow.end(job_complete=False, last_persisted=4, given_up=set(), wait_s=0.1)
        for w in writers.values():
            w.close()
        shutil.rmtree(root, ignore_errors=True)

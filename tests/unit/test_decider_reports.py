"""A keeper's reports to the decider in a real job master (``decider_actor.Reporter``): its holdings, the
steps due, its workers' end, and a due step pinned on sight until the decider's word."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider_actor import Reporter, holdings, pin_on_sight
from stalwart.checkpoint.decider_link import DeciderLink

from .test_master_ckpt import RANKS, Keeper, started_master


@pytest.fixture
def master(tmp_path):
    yield from started_master(tmp_path)


def steps_of(node: str, *due: int, epoch: int = 0) -> dict:
    return {r: {s: {"epoch": epoch, "persist": True} for s in due} for r in RANKS[node]}


def test_holdings_name_each_snapshot_by_step_and_epoch():
    steps = {0: {4: {"epoch": 1}, 5: {"epoch": 1}}, 1: {4: {"epoch": 1}}}
    assert holdings(steps) == ((4, 1, (0, 1), False), (5, 1, (0,), False))
    copies = {0: {5: {"epoch": 1}}, 3: {4: {"epoch": 1}}}  # peer copies: rank 3's counts, rank 0's twice once
    assert holdings(steps, {(5, 1)}, copies) == ((4, 1, (0, 1, 3), False), (5, 1, (0,), True))


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
    """What the reporter reads of a node's job: its execution and its snapshots."""

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
    reporter = Reporter(DeciderLink(master.address, "token", "n0", every_s=0.02), lambda: True)
    try:
        job, owners = OneNode(steps_of("n0", 4, 6)), {r: {"pid": w.pid} for r, w in zip(RANKS["n0"], workers)}
        workers[0].kill(), workers[0].wait()
        reporter.workers_died(job, 4, owners, {workers[0].pid})
        assert reporter.link.pending() == 0 and master.state.ckpt.state()["failure"] is None, "rank 1 still runs"
        workers[1].kill(), workers[1].wait()  # (SIGKILL: a test process may pass SIGTERM ignored on)
        reporter.workers_died(job, 4, owners, {workers[0].pid})
        assert reporter.link.sync(5)
        final = master.state.ckpt.state()["failure"]["final"]
        assert final == {"n0": {"4:0": [0, 1, 2], "6:0": [0, 1]}}, final
    finally:
        for w in workers:
            w.kill()
        reporter.link.close()


class NextExecution(OneNode):
    """job.json as the next execution's workers rewrote it."""

    def epoch(self) -> int:
        return 1


def test_dead_workers_of_an_earlier_execution_open_no_failure_of_the_next(master):
    """The keeper read its workers' records (all dead, of epoch 0); meanwhile the next execution formed
    and its workers rewrote job.json (epoch 1) before their own records replaced the dead ones. The
    report names the dead workers' execution, already over: had it named epoch 1, the decider would wait
    for that execution's save-on-failure and persist nothing more (found in CI: a job that never
    persisted again after a restart, its workers waiting at their end)."""
    for epoch in (0, 1):
        for node in RANKS:
            Keeper(master, node).member(epoch)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    reporter = Reporter(DeciderLink(master.address, "token", "n0", every_s=0.02), lambda: True)
    try:
        owners = {r: {"pid": pid, "rank": r, "epoch": 0} for r in RANKS["n0"]}
        reporter.workers_died(NextExecution(steps_of("n0", 4)), 4, owners, {pid})
        assert reporter.link.sync(5) and reporter.link.pending() == 0
        state = master.state.ckpt.state()
        assert state["epoch"] == 1 and state["failure"] is None, state
        assert reporter.gone == {0}, "the report named the dead workers' execution"
    finally:
        reporter.link.close()


def test_a_keeper_reports_no_membership_from_a_job_file_an_earlier_launch_left(master):
    from stalwart.checkpoint.desk_host import Membership

    members = Membership(master.address, "token", "n0", agent="launch-2")
    members.report_member(3, RANKS["n0"], 4, agent="launch-1")  # job.json of the last launch's workers
    assert master.state.ckpt.ranks_of("n0") == []
    members.report_member(0, RANKS["n0"], 4, agent="launch-2")
    assert master.state.ckpt.ranks_of("n0") == [0, 1]


def test_a_keeper_pins_a_due_step_on_sight_until_its_end(master, tmp_path):
    """The workers move on for several steps before the decider's plan comes back: the step due for
    persistence stays in memory, pinned (the writer takes the other slot) and reported pinned; the
    keeper's end unpins it (a Release does while it runs: ``test_decider_actor``)."""
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
    reporter = Reporter(DeciderLink(master.address, "token", "n0", every_s=0.02), lambda: True, pin)
    decider = master.state.ckpt.state

    def snapshot(step: int, ranks=RANKS["n0"]) -> None:
        for r in ranks:
            writers[r].start(step, state.capture(), persist=step % 4 == 0)
            writers[r].wait()

    def held_steps() -> set[int]:
        return set.intersection(*(set(v) for v in job.snapshot_steps(4, RANKS["n0"]).values()))

    try:
        snapshot(4, [0])
        reporter.observe(job.snapshot_steps(4, RANKS["n0"]), [])
        assert not reporter.sight, "pinned once every rank of the node holds it, not before"
        snapshot(4, [1])
        reporter.observe(job.snapshot_steps(4, RANKS["n0"]), [4])
        assert list(reporter.sight) == [(4, 0)]
        for step in (5, 6, 7):  # faster than any round trip to the decider
            snapshot(step)
        assert held_steps() == {4, 7}, "the pinned slot is kept, the other one reused"
        reporter.observe(job.snapshot_steps(4, RANKS["n0"]), [4])
        deadline = time.monotonic() + 10
        while (decider() or {}).get("pins", {}).get("n0") != [[4, 0]] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert decider()["pins"]["n0"] == [[4, 0]], "the pin is reported to the decider"
        reporter.end(job_complete=False, wait_s=0.1)
        assert not reporter.sight
        snapshot(8)
        assert held_steps() == {7, 8}, "unpinned, the slot of step 4 is reused"
    finally:
        reporter.link.close()
        for w in writers.values():
            w.close()
        shutil.rmtree(root, ignore_errors=True)

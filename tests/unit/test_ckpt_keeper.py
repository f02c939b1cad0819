"""The agent's keeper (``--parent``): it waits for the workers' job.json, learns storage and policy from
it, persists, and on SIGTERM or the agent's death finishes and exits; a Checkpointer under an agent
starts no keeper of its own."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from torch import nn

from stalwart import runtime
from stalwart.checkpoint import Checkpointer, NodeJob, Storage
from stalwart.checkpoint.keeper_link import spawn_keeper
from stalwart.checkpoint.snapshot import SnapshotWriter
from stalwart.checkpoint.state import TrainingState
from stalwart.launch import run_args


@pytest.fixture
def root():
    path = Path("/dev/shm") / f"stalwart-keeper-{uuid.uuid4().hex[:8]}" / "job"
    yield path
    shutil.rmtree(path.parent, ignore_errors=True)


def _until(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _snapshot(job: NodeJob, steps: list[int], persist: set[int], rank: int = 0, world: int = 1) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState({"model": model, "optim": opt}, rank)
    writer = SnapshotWriter(job.paths, rank, world)
    for step in steps:
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        writer.start(step, state.capture(), persist=step in persist)
        writer.wait()
    writer.close()


def test_agent_keeper_learns_storage_from_job_json_and_stops_on_sigterm(root, tmp_path):
    job = NodeJob(root)
    keeper = spawn_keeper(job, tmp_path / "agent-keeper.log", parent=os.getpid(), grace_s=20)
    try:
        time.sleep(0.5)
        assert keeper.poll() is None and not job.keeper_alive()  # no job yet: it waits, serving nothing
        assert _until(lambda: "serving agent pid" in (tmp_path / "agent-keeper.log").read_text(), 120.0)
        assert not _loads_torch(keeper.pid), "torch is imported only once a job needs it"
        _snapshot(job, [1, 2], persist={2})
        job.paths.owner(0).write_text(f'{{"pid": {os.getpid()}, "rank": 0, "world_size": 1}}')  # a live worker
        storage = Storage(str(tmp_path / "ckpt"))
        job.write_job(
            storage,
            1,
            [0],
            {"persist_every_steps": 2, "persist_every_s": 0, "keep_last": 3, "keep_every": 0, "idle_s": 0.1},
            keeper=True,
            keeper_log=tmp_path / "job.log",
        )
        assert _until(lambda: storage.latest() == 2), (tmp_path / "agent-keeper.log").read_text()
        assert job.keeper_alive()
        time.sleep(0.5)  # far beyond idle_s: the agent's keeper does not idle out, the agent ends it
        assert keeper.poll() is None
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(20) == 0
        assert not root.exists(), "storage holds the newest snapshot: the snapshots are removed"
        assert "committed step 2" in (tmp_path / "job.log").read_text()  # also logs where the workers asked
    finally:
        keeper.kill()


def _loads_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps (Linux)")
def test_agent_keeper_of_a_job_that_never_checkpoints_never_imports_torch(root, tmp_path):
    """A script under `stalwart run` that uses no stalwart checkpoint: its node's keeper waits without
    torch and DCP (~5 CPU-s and ~0.3 GB per node start), and stopped, leaves no directory behind. It gets
    the environment the agent gives it, replica settings included (replicas off: "0")."""
    job, log = NodeJob(root), tmp_path / "agent-keeper.log"
    args = run_args.build_parser().parse_args(["--nproc-per-node", "1", "script.py"])
    agent_env = run_args.replica_env(args, "127.0.0.1", "job-token")
    assert agent_env[runtime.ENV_REPLICAS] == "0"
    keeper = spawn_keeper(job, log, parent=os.getpid(), grace_s=20, env=agent_env)
    try:
        assert _until(lambda: log.exists() and "serving agent pid" in log.read_text(), 120.0), "the keeper never served"
        time.sleep(0.3)  # a few of its polls for job.json
        assert not _loads_torch(keeper.pid), "an idle keeper loaded torch"
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(20) == 0, log.read_text()
        assert not root.exists(), "the directory of a job that never came is removed"
    finally:
        keeper.kill()
    # The trainer's agent asks for it at once (`--eager`): its first persist does not wait for the imports
    eager = spawn_keeper(job, log, parent=os.getpid(), grace_s=20, eager=True)
    try:
        assert _until(lambda: _loads_torch(eager.pid), 120.0), "an eager keeper never imported torch"
        eager.send_signal(signal.SIGTERM)
        assert eager.wait(20) == 0, log.read_text()
        assert not root.exists()
    finally:
        eager.kill()


def test_agent_keeper_saves_on_failure_when_stopped(root, tmp_path):
    """A worker died (its owner pid is gone) and never closed: stopping, the keeper persists the newest
    step all ranks hold although no persist was due."""
    job = NodeJob(root)
    _snapshot(job, [1, 2, 3], persist=set())
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    job.paths.owner(0).write_text(f'{{"pid": {int(dead.stdout)}, "rank": 0, "world_size": 1}}')
    storage = Storage(str(tmp_path / "ckpt"))
    job.write_job(
        storage,
        1,
        [0],
        {"persist_every_steps": 0, "persist_every_s": 0, "keep_last": 3, "keep_every": 0, "idle_s": 120},
        keeper=True,
        keeper_log=None,
    )
    keeper = spawn_keeper(job, tmp_path / "keeper.log", parent=os.getpid(), grace_s=20)
    try:
        assert _until(lambda: storage.latest() == 3), (tmp_path / "keeper.log").read_text()
        keeper.send_signal(signal.SIGTERM)
        assert keeper.wait(20) == 0
        assert "save-on-failure step 3" in (tmp_path / "keeper.log").read_text()
    finally:
        keeper.kill()


def test_agent_keeper_exits_when_the_agent_is_killed(root, tmp_path):
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import os, sys, time; from stalwart.checkpoint import NodeJob; "
                "from stalwart.checkpoint.keeper_link import spawn_keeper; "
                f"p = spawn_keeper(NodeJob({str(root)!r}), {str(tmp_path / 'keeper.log')!r}, parent=os.getpid()); "
                "print(p.pid, flush=True); time.sleep(600)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    keeper_pid = int(agent.stdout.readline())
    log = tmp_path / "keeper.log"
    try:
        # once it serves (it watches its agent from then on; its imports took > 1 s on a loaded host)
        assert _until(lambda: log.exists() and "serving agent pid" in log.read_text(), 120.0), "the keeper never served"
        assert psutil.pid_exists(keeper_pid)
        agent.kill()
        agent.wait()
        assert _until(lambda: not _running(keeper_pid), 10.0), "the keeper outlived its agent"
    finally:
        if _running(keeper_pid):
            os.kill(keeper_pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_checkpointer_under_an_agent_starts_no_keeper(monkeypatch, tmp_path):
    job_id, node_id = f"test-{uuid.uuid4().hex[:8]}", "node-a"
    monkeypatch.setenv("STALWART_PROGRESS_DIR", str(tmp_path / "progress"))
    monkeypatch.setenv("STALWART_JOB_ID", job_id)
    monkeypatch.setenv("STALWART_NODE_ID", node_id)
    runtime.reset()
    expected = NodeJob.of_agent(job_id, node_id)
    try:
        ck = Checkpointer(str(tmp_path / "ckpt"), persist_every_steps=2)
        assert ck.keeper.by_agent and ck.paths.root == expected.root
        model = nn.Linear(4, 4)
        ck.save(1, {"model": model})
        ck.wait()
        assert ck.keeper.proc is None and not ck.job.keeper_alive()
        assert ck.job.job()["keeper"] is True and ck.job.persists()
        ck.close()
    finally:
        runtime.reset()
        shutil.rmtree(expected.root, ignore_errors=True)


def test_persist_waits_for_the_writer_to_release_a_slot_it_just_published(root, tmp_path):
    """The writer publishes a slot's header a moment before it unlocks the slot: a keeper that looks in
    that moment must persist the step, not skip it as overwritten."""
    import fcntl
    import threading

    job = NodeJob(root)
    _snapshot(job, [1, 2], persist={2})
    [newest, _] = sorted(job.paths.rank_dir(0).glob("slot*.json"), key=lambda p: -p.stat().st_mtime_ns)
    fd = os.open(newest.with_suffix(".bin"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as the writer holds it until just after publishing
    threading.Timer(0.3, os.close, (fd,)).start()
    manifest = job.persist_step(Storage(str(tmp_path / "ckpt")), 2, 1, "test")
    assert manifest["step"] == 2 and not manifest.get("already")


def test_a_node_given_another_rank_by_a_regrouping_sees_its_new_world(root, tmp_path):
    """A grow can give this node rank 1 where it held rank 0 (TorchElastic orders agents by pid, and
    pids wrap): rank0/ keeps the old world's owner record. The node's world is the newest record's; a
    keeper that read rank0/'s found none of rank 1's snapshots and never persisted again (a CI hang)."""
    job = NodeJob(root)
    _snapshot(job, [78, 79], persist=set())  # rank 0 of the shrunk, one-rank world
    job.paths.owner(0).write_text('{"pid": 1, "rank": 0, "world_size": 1, "time": 100.0}')
    _snapshot(job, [80], persist={80}, rank=1, world=2)  # rank 1 of the grown world
    job.paths.owner(1).write_text(f'{{"pid": {os.getpid()}, "rank": 1, "world_size": 2, "time": 200.0}}')
    job.write_job(Storage(str(tmp_path / "ckpt")), 2, [1], {"persist_every_steps": 5}, keeper=True, keeper_log=None)
    assert job.world() == 2
    assert job.newest_agreed(job.world()) == 80


def test_a_rollback_note_makes_the_keeper_forget_the_abandoned_future(root, tmp_path):
    """What the keeper persisted, gave up and reported of steps after the rollback's target carries
    the redone steps' numbers: all of it goes, or a redone step would never be persisted (``last
    persisted`` 8) or its waiter would read the abandoned "skipped 6" as its own."""
    import json

    from stalwart.checkpoint.keeper import Keeper

    job, storage = NodeJob(root), Storage(str(tmp_path / "ckpt"))
    job.root.mkdir(parents=True, mode=0o700)
    job.write_job(storage, 1, [0], {"persist_every_steps": 2}, keeper=True, keeper_log=None)
    keeper = Keeper(job)
    keeper.last_persisted, keeper.given_up = 8, {3: None, 6: 1.0}
    for kind, step in (("committed", 4), ("skipped", 6), ("committed", 8)):
        keeper.event(kind, step, "before the rollback")
    (tmp_path / "ckpt").mkdir()
    storage.set_latest(4)  # the rollback moved it back
    job.paths.rollback_note.write_text('{"step": 4, "id": "r1"}')
    keeper._follow_rollback()
    status = json.loads(job.paths.keeper_status.read_text())
    assert (status["rollback"], status["last_committed"], keeper.given_up) == ("r1", 4, {3: None})
    assert [(e["kind"], e["step"]) for e in status["events"]] == [("committed", 4), ("rollback", 4)]
    keeper.last_persisted = 6
    keeper._follow_rollback()  # the same note again: nothing to do
    assert keeper.last_persisted == 6


def test_a_step_one_rank_of_the_node_no_longer_holds_is_given_up_by_every_rank(root):
    """The keeper persists a step only when all the node's ranks hold it. Rank 0's copy of step 8 was
    overwritten (its two slots hold 9 and 10) while rank 1's was not: rank 1 must give the step up
    as rank 0 does, not wait out the persist timeout while rank 0 went on into the next collective
    (a guard rollback hung so in CI)."""
    from stalwart.checkpoint.keeper_link import KeeperLink
    from stalwart.checkpoint.storage_health import StorageNews

    job = NodeJob(root)
    _snapshot(job, [7, 8, 9, 10], persist={8}, rank=0, world=2)
    _snapshot(job, [7, 8, 9], persist={8}, rank=1, world=2)  # rank 1 still holds 8 and 9
    links = {
        r: KeeperLink(
            job,
            r,
            r,
            by_agent=True,
            log_path=None,
            timeout_s=10,
            storage_news=StorageNews("", False),
            node_ranks=[0, 1],
        )
        for r in (0, 1)
    }
    assert not links[1].node_holds(8) and links[1].node_holds(9)
    for rank, link in links.items():
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="no longer held in memory by all of this node's ranks"):
            link.wait_persisted(8)
        assert time.monotonic() - t0 < 5, f"rank {rank} waited for a persist nobody makes"


def test_a_keeper_across_nodes_leaves_a_torn_step_newer_than_latest_to_the_plan_writing_it(root, tmp_path):
    """A spare's keeper that becomes rank 0's node starts while the other nodes' keepers write the
    decider's save of step 39 (latest 30): removing step 39 then failed its commit (seen in
    benchmarks/node_loss.py). Across nodes only torn steps older than latest go; on one node, under
    the persist lock, every torn one."""
    from stalwart.checkpoint.node_job import tidy_storage
    from stalwart.checkpoint.storage import MANIFEST, step_name

    job, storage = NodeJob(root), Storage(str(tmp_path / "ckpt"))
    job.root.mkdir(parents=True, mode=0o700)
    for step in (25, 30, 39):
        (tmp_path / "ckpt" / step_name(step)).mkdir(parents=True)
    (tmp_path / "ckpt" / step_name(30) / MANIFEST).write_text('{"step": 30}')
    storage.set_latest(30)
    removed = []

    def event(kind, step, detail, level=None):
        removed.append((kind, step))

    tidy_storage(job, storage, event, None, across=True)
    assert removed == [("removed-torn", 25)] and storage.steps() == [30, 39]
    tidy_storage(job, storage, event, None)
    assert removed[-1] == ("removed-torn", 39) and storage.steps() == [30]

"""The multi-node commit protocol in one process: two "nodes" (threads), each with its own job
directory in /dev/shm holding one rank's snapshots, persist one step together; a node that lacks the
step makes the coordinator give up quickly instead of waiting out the timeout."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from stalwart.checkpoint import NodeJob, Storage, multinode, stage
from stalwart.checkpoint.membership import LostNodes, NodeLost
from stalwart.checkpoint.shm import JobPaths, atomic_write
from stalwart.checkpoint.snapshot import SnapshotWriter
from stalwart.checkpoint.state import TrainingState
from stalwart.launch import preempt
from stalwart.runtime import ENV_JOB_TOKEN, ENV_MASTER, ENV_NODE_ID, ENV_SHARED_MASTER

WORLD = 2


def two_node_dirs():
    """Two node-local job directories; rank r's snapshots live on node r."""
    roots = [Path("/dev/shm") / f"stalwart-mn-{uuid.uuid4().hex[:8]}" for _ in range(WORLD)]
    paths = [JobPaths(r) for r in roots]
    for rank, p in enumerate(paths):
        p.root.mkdir(parents=True)
        atomic_write(p.job, f'{{"storage": "unused", "world_size": {WORLD}, "ranks": [{rank}]}}'.encode())
    yield paths
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)


@pytest.fixture
def nodes():
    yield from two_node_dirs()


def snapshot(paths: JobPaths, rank: int, steps: list[int], epoch: int = 0) -> nn.Module:
    """Rank ``rank`` trains a replicated model (same seed on every rank, like DDP) and snapshots ``steps``
    in execution ``epoch``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainingState({"model": model, "optim": opt}, rank)
    writer = SnapshotWriter(paths, rank, WORLD, epoch=epoch)
    for s in range(1, max(steps) + 1):
        torch.manual_seed(s)
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if s in steps:
            writer.start(s, state.capture(), persist=True)
            writer.wait()
    writer.close()
    return model


def run_nodes(nodes: list[JobPaths], storage: Storage, step: int, late_s: float = 0.0) -> list[object]:
    """Both nodes' persist_step for ``step`` concurrently (rank 1's node ``late_s`` later); returns each
    node's manifest or exception."""
    out: list[object] = [None] * WORLD

    def node(rank: int) -> None:
        time.sleep(late_s * rank)
        try:
            out[rank] = NodeJob(nodes[rank].root).persist_step(storage, step, WORLD, "test", ranks=[rank])
        except Exception as err:
            out[rank] = err

    threads = [threading.Thread(target=node, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_two_nodes_write_their_own_shards_and_the_coordinator_commits(nodes, tmp_path):
    model = snapshot(nodes[0], 0, [3])
    snapshot(nodes[1], 1, [3])
    storage = Storage(str(tmp_path / "ckpt"))
    coordinator, participant = run_nodes(nodes, storage, 3)
    assert isinstance(coordinator, dict) and isinstance(participant, dict), (coordinator, participant)
    assert storage.latest() == 3 and storage.verify(3) == []
    manifest = storage.manifest(3)
    assert manifest["world_size"] == WORLD and manifest["source"] == "test"
    assert {name.split("_")[2] for name in manifest["files"] if name.endswith(".distcp")} == {"0", "1"}
    target = {f"model.{k}": torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(target, checkpoint_id=storage.checkpoint_id(3), no_dist=True)  # plain DCP reads it
    assert all(torch.equal(target[f"model.{k}"], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "ckpt" / ".stage" / "step-00000003").exists()
    # Persisting a committed step again is a no-op for both nodes, never a rewrite.
    again = run_nodes(nodes, storage, 3)
    assert all(isinstance(m, dict) and m.get("already") for m in again), again


def test_a_late_heartbeat_never_writes_the_stage_back_after_the_commit(nodes, tmp_path, monkeypatch):
    # A beat that is still being written when the participant's results go in lands after the
    # coordinator committed and removed the stage (seen once in a full run): here every beat waits for
    # exactly that. The participant must stop beating before it hands in its results.
    snapshot(nodes[0], 0, [3])
    snapshot(nodes[1], 1, [3])
    storage, put = Storage(str(tmp_path / "ckpt")), stage.put
    step_dir = tmp_path / "ckpt" / ".stage" / "step-00000003"

    def late_beat(storage: Storage, obj: object, *parts: str) -> None:
        if "alive" in parts:
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline and not list((step_dir / "results").glob("rank1.*")):
                time.sleep(0.01)  # until the results are in ...
            while time.monotonic() < deadline and step_dir.exists():
                time.sleep(0.01)  # ... and the coordinator has committed and removed the stage
        put(storage, obj, *parts)

    monkeypatch.setattr(stage, "put", late_beat)
    coordinator, participant = run_nodes(nodes, storage, 3)
    assert isinstance(coordinator, dict) and isinstance(participant, dict), (coordinator, participant)
    assert storage.latest() == 3 and not step_dir.exists(), sorted(p.name for p in step_dir.rglob("*"))


def test_a_node_without_the_step_makes_the_coordinator_give_up_at_once(nodes, tmp_path):
    snapshot(nodes[0], 0, [4])
    snapshot(nodes[1], 1, [5])  # rank 1 never held step 4
    storage = Storage(str(tmp_path / "ckpt"))
    t0 = time.monotonic()
    coordinator, participant = run_nodes(nodes, storage, 4)
    assert isinstance(participant, LookupError) and isinstance(coordinator, stage.MissingSnapshot)
    assert time.monotonic() - t0 < 30, "answered, not timed out"
    assert storage.latest() is None and 4 not in storage.steps()


def test_a_node_lost_while_writing_is_given_up_after_its_heartbeat_stops(nodes, tmp_path):
    snapshot(nodes[0], 0, [2])
    snapshot(nodes[1], 1, [2])
    storage = Storage(str(tmp_path / "ckpt"))
    # Rank 1's node publishes its table (as its keeper would) and then dies: no heartbeat, no shards.
    from stalwart.checkpoint.shm import complete_slots
    from stalwart.checkpoint.snapshot import SnapshotView

    with SnapshotView(nodes[1], complete_slots(nodes[1], 1)[0]) as view:
        from stalwart.checkpoint.persist import plan_table

        stage.put(storage, {**plan_table(view), "first": 1}, *stage.stage_of(2, "plans", "rank1.json"))
    with SnapshotView(nodes[0], complete_slots(nodes[0], 0)[0]) as view:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="stopped writing"):
            multinode.persist(storage, 2, {0: view}, WORLD, "test", coordinator=True, timeout_s=120, answer_s=1.0)
    assert time.monotonic() - t0 < 60, "gave up on the lost node long before the persist timeout"
    assert storage.latest() is None
    assert stage.get(storage, *stage.stage_of(2, "abort.json")), "participants are told to stop"


@pytest.fixture
def master(tmp_path):
    """A real job master (HTTP, journal) that knows nodes n0 and n1."""
    from stalwart.launch.client import MasterClient
    from stalwart.launch.master import Master

    m = Master(tmp_path / "journal.sqlite", "token").start()
    for node in ("n0", "n1"):
        MasterClient(m.address, "token").join(node, "host", 1)
    yield m
    m.stop()


def members_of(master, me: str) -> LostNodes:
    env = {ENV_MASTER: master.address, ENV_JOB_TOKEN: "token", ENV_NODE_ID: me, ENV_SHARED_MASTER: "1"}
    members = LostNodes.from_env(env)
    assert members is not None and members.me == me
    return members


def lose(master, node: str, started: threading.Event) -> float:
    """Once ``started``, the master records ``node`` lost (what its presence handler does when the
    node's connection breaks); returns the master's lost_at for it."""
    assert started.wait(30)
    master.state.presence_lost(node)
    return next(float(n["lost_at"]) for n in master.state.lost()["lost"] if n["node_id"] == node)


def lost_while_persisting(master, nodes, storage, rank: int, lost: str, once_planned: bool = False) -> Exception:
    """Node ``n{rank}`` takes part in persisting step 2 (rank 0's node coordinates) while the master loses
    node ``lost`` (once the coordinator planned, or at once); returns the error it gave up with, which
    must be NodeLost within 1 s of the master's loss record (never ``answer_s``, 60 s here)."""
    from stalwart.checkpoint.shm import complete_slots
    from stalwart.checkpoint.snapshot import SnapshotView

    ready, out = threading.Event(), {}

    def take_part() -> None:
        with SnapshotView(nodes[rank], complete_slots(nodes[rank], rank)[0]) as view:
            if not once_planned:
                ready.set()
            try:
                multinode.persist(
                    storage,
                    2,
                    {rank: view},
                    WORLD,
                    "test",
                    rank == 0,
                    answer_s=60,
                    on_planned=(lambda _: ready.set()) if once_planned else None,
                    members=members_of(master, f"n{rank}"),
                )
            except Exception as err:
                out["error"], out["at"] = err, time.time()

    thread = threading.Thread(target=take_part)
    thread.start()
    lost_at = lose(master, lost, ready)
    thread.join(30)
    assert isinstance(out.get("error"), NodeLost), out
    assert out["at"] - lost_at <= 1.0, f"given up {out['at'] - lost_at:.2f} s after the master's loss record"
    return out["error"]


def test_a_participant_lost_during_the_persist_is_given_up_within_a_second_of_the_masters_record(
    nodes, tmp_path, master
):
    """Issue 30: a lost node is known from membership, not from its heartbeat going stale."""
    from stalwart.checkpoint.persist import plan_table
    from stalwart.checkpoint.shm import complete_slots
    from stalwart.checkpoint.snapshot import SnapshotView

    snapshot(nodes[0], 0, [2])
    snapshot(nodes[1], 1, [2])
    storage = Storage(str(tmp_path / "ckpt"))
    with SnapshotView(nodes[1], complete_slots(nodes[1], 1)[0]) as view:  # node n1 published its table ...
        table = {**plan_table(view), "first": 1, "node": "n1"}
        stage.put(storage, table, *stage.stage_of(2, "plans", "rank1.json"))
    # ... and is lost while the coordinator waits for its shards
    assert "n1" in str(lost_while_persisting(master, nodes, storage, 0, "n1", once_planned=True))
    assert storage.latest() is None
    assert stage.get(storage, *stage.stage_of(2, "abort.json")), "participants are told to stop"


def test_a_node_lost_before_its_table_is_given_up_from_the_ranks_its_keeper_reported(nodes, tmp_path, master):
    """Issue 30: a node lost before it wrote a word for this step. Its keeper had told the master its
    ranks (``Member``), so the coordinator gives up at once instead of waiting out ``answer_s``."""
    snapshot(nodes[0], 0, [2])
    for node, ranks in (("n0", [0]), ("n1", [1])):
        members_of(master, node).report_member(0, ranks, WORLD)
    assert master.state.ckpt.state()["nodes"] == {"n0": [0], "n1": [1]}, "both reports formed epoch 0"
    storage = Storage(str(tmp_path / "ckpt"))
    assert "rank 1's node n1" in str(lost_while_persisting(master, nodes, storage, 0, "n1"))
    assert storage.latest() is None


def test_a_save_on_failure_after_a_node_loss_says_so_at_once(nodes, tmp_path, master):
    """The agent's save-on-failure after losing a node: nothing can be saved (its ranks' snapshots went
    with it). It said so after waiting ``answer_s`` (10 s) for each step this node holds; now at once."""
    snapshot(nodes[0], 0, [2, 4])
    for node, ranks in (("n0", [0]), ("n1", [1])):
        members_of(master, node).report_member(0, ranks, WORLD)
    master.state.presence_lost("n1")
    storage = Storage(str(tmp_path / "ckpt"))
    t0 = time.monotonic()
    said = NodeJob(nodes[0].root).save_on_failure(storage.url, world_size=WORLD, members=members_of(master, "n0"))
    assert time.monotonic() - t0 < 2.0, f"took {time.monotonic() - t0:.1f} s"
    assert not said["persisted"] and "rank 1's node n1 is lost" in said["detail"], said
    assert storage.latest() is None


def test_a_participant_stops_waiting_for_a_coordinator_the_master_holds_lost(nodes, tmp_path, master):
    from stalwart.checkpoint.shm import complete_slots
    from stalwart.checkpoint.snapshot import SnapshotView

    snapshot(nodes[0], 0, [2])
    snapshot(nodes[1], 1, [2])
    storage = Storage(str(tmp_path / "ckpt"))
    with SnapshotView(nodes[0], complete_slots(nodes[0], 0)[0]) as view:  # n0 published its table, no plan yet
        multinode._put_table(storage, 2, 0, {0: view}, "n0")
    assert "coordinator" in str(lost_while_persisting(master, nodes, storage, 1, "n0"))


def test_without_a_master_nothing_is_known_lost():
    assert LostNodes.from_env({ENV_NODE_ID: "n0"}) is None
    assert LostNodes.from_env({ENV_MASTER: "http://127.0.0.1:9", ENV_JOB_TOKEN: "t"}) is None  # no node id
    env = {ENV_MASTER: "http://127.0.0.1:9", ENV_JOB_TOKEN: "t", ENV_NODE_ID: "n0"}
    assert LostNodes.from_env(env) is None, "a master of one node's own: the decider is rank 0's keeper's"
    unreachable = LostNodes.from_env({**env, ENV_SHARED_MASTER: "1"})
    assert unreachable is not None and not unreachable.lost("n1"), "a master that does not answer loses nobody"


def test_a_rollback_forgets_the_stage_so_a_redone_step_is_persisted_by_both_nodes(nodes, tmp_path):
    """After a rollback from 8 to 4, rank 1's cursor still said "moved on to step 8": the coordinator
    gave the redone step 6 up at once when it came first. The rollback's forget_after clears it."""
    storage = Storage(str(tmp_path / "ckpt"))
    for rank in range(WORLD):
        snapshot(nodes[rank], rank, [4, 8])
    assert [isinstance(m, dict) for m in run_nodes(nodes, storage, 4)] == [True, True]
    assert [isinstance(m, dict) for m in run_nodes(nodes, storage, 8)] == [True, True]
    stage.request(storage, 8)  # a save-on-failure's request, still open
    assert storage.forget_after(4) == [8] and storage.latest() == 4
    stage.forget_after(storage, 4)
    assert stage.requested_step(storage) is None
    for rank in range(WORLD):
        snapshot(nodes[rank], rank, [6])  # the redone trajectory
    coordinator, participant = run_nodes(nodes, storage, 6, late_s=1.0)
    assert isinstance(coordinator, dict) and isinstance(participant, dict), (coordinator, participant)
    assert storage.committed() == [6, 4] and storage.verify(6) == []
    # A rollback below every committed step (to a memory snapshot): no ``latest`` names a deleted step.
    assert storage.forget_after(3) == [4, 6] and storage.latest() is None and storage.committed() == []


def test_a_commit_clears_the_stage_of_the_steps_before_it(nodes, tmp_path):
    """Under load the coordinator gave steps 4 and 8 up (training outpaced persistence); their stage
    directories (abort.json, a plan table) stayed after step 12's commit until a keeper started again."""
    storage = Storage(str(tmp_path / "ckpt"))
    multinode.abort(storage, 2, "rank 0 no longer holds a snapshot of step 2")
    stage.answer_missing(storage, 3, [1], "this node holds steps []")
    for rank in range(WORLD):
        snapshot(nodes[rank], rank, [4])
    assert [isinstance(m, dict) for m in run_nodes(nodes, storage, 4)] == [True, True]
    assert not list((tmp_path / "ckpt" / ".stage").glob("step-*")), "finished steps leave no stage"


EPOCH = 3  # the execution that fails in these tests (a job restarted three times before)


def skew_clock(paths: JobPaths, rank: int, seconds: float) -> None:
    """Rank ``rank``'s node's clock runs ``seconds`` ahead: shift every time its snapshot headers hold."""
    for slot in paths.rank_dir(rank).glob("slot*.json"):
        header = json.loads(slot.read_text())
        header.update(time=header["time"] + seconds, captured=header["captured"] + seconds)
        atomic_write(slot, json.dumps(header).encode())


def preempted(nodes: list[JobPaths], storage: Storage, skew_s: float = 0.0) -> None:
    """Rank 0 holds step 8, rank 1 steps 8 and 9 (its copy of 9 done, rank 0's not), both of execution
    EPOCH; each node's job persists to ``storage``. Rank 1's node's clock runs ``skew_s`` ahead."""
    for rank, steps in ((0, [8]), (1, [8, 9])):
        snapshot(nodes[rank], rank, steps, epoch=EPOCH)
        job = {"storage": storage.url, "world_size": WORLD, "ranks": [rank], "epoch": EPOCH}
        atomic_write(nodes[rank].job, json.dumps({**job, "policy": {"persist_every_steps": 100}}).encode())
        atomic_write(nodes[rank].owner(rank), json.dumps({"pid": 1, "rank": rank, "world_size": WORLD}).encode())
    skew_clock(nodes[1], 1, skew_s)


def test_a_preempted_node_holding_a_newer_step_stops_waiting_when_rank_0s_node_settles(nodes, tmp_path):
    """CI (Slurm preemption): rank 1 had published step 9, rank 0 only 8, so the save-on-failure
    committed 8. Rank 1's agent waited for 9 until Slurm killed it, KillWait seconds after the requeue,
    before it wrote its summary. It now stops at rank 0's node's word that the save settled — this
    notice's word, not that of an earlier execution's fault."""
    storage = Storage(str(tmp_path / "ckpt"))
    stage.settle(storage, EPOCH - 1, None, "an earlier execution's save, settled late")
    preempted(nodes, storage)
    assert [isinstance(m, dict) for m in run_nodes(nodes, storage, 8)] == [True, True]  # the keepers' save
    node1 = NodeJob(nodes[1].root)
    early = preempt.wait_committed(node1, timeout_s=0.5)
    assert not early["persisted"] and early["step"] == 9, f"no word of this notice yet: step 9 awaited {early}"

    said = NodeJob(nodes[0].root).save_on_failure(storage.url, world_size=WORLD, quiet=True)  # the agent's save
    assert said["step"] == 8 and "already covered" in said["detail"], said
    waited = preempt.wait_committed(node1, timeout_s=30)
    assert waited["persisted"] and waited["step"] == 8 and "settled" in waited["detail"], waited


def test_a_save_on_failure_that_fails_still_settles(nodes, tmp_path, monkeypatch):
    """A participant that never answers (TimeoutError) or storage that fails: the save is over all the
    same, and a waiting node must hear it rather than wait for a commit that will not come."""
    storage = Storage(str(tmp_path / "ckpt"))
    preempted(nodes, storage)

    def fails(*_args: object, **_kwargs: object) -> None:
        raise TimeoutError("persist of step 8: timed out waiting for rank 1's table")

    monkeypatch.setattr(NodeJob, "persist_step", fails)
    with pytest.raises(TimeoutError):
        NodeJob(nodes[0].root).save_on_failure(storage.url, world_size=WORLD, quiet=True)
    waited = preempt.wait_committed(NodeJob(nodes[1].root), timeout_s=30)
    assert not waited["persisted"] and waited["step"] is None and "timed out" in waited["detail"], waited
    atomic_write(nodes[1].job, json.dumps({"storage": storage.url, "ranks": [1]}).encode())  # no persist policy
    memory_only = preempt.wait_committed(NodeJob(nodes[1].root), timeout_s=30)
    assert memory_only == {"persisted": False, "detail": "memory-only checkpoints: nothing to persist"}


@pytest.mark.parametrize("skew_s", [0.0, 5.0], ids=["same-clock", "participant-clock-5s-ahead"])
def test_a_node_waiting_on_a_step_rank_0_will_never_hold_is_called_back_by_save_on_failure(nodes, tmp_path, skew_s):
    """Rank 0 died copying step 9, which rank 1's keeper had begun to persist (its cursor: 9). Its
    keeper waited 120 s for a plan that could never come, and the cursor made save-on-failure read
    every older step as "moved on": nothing was saved although both ranks held step 8. Save-on-failure
    now declares the failure: a snapshot of a later step taken before it is a dead end, whenever its
    keeper meets it, and the keeper comes back for the step asked for. The redo of step 9 is another
    snapshot, persisted. A dead end is a snapshot of the failed execution (an epoch), not one taken
    before a time: with the participant's clock 5 s ahead, the rule by clocks (its capture time against
    the failure's start on rank 0's clock) let it wait out the 120 s persist timeout."""
    storage = Storage(str(tmp_path / "ckpt"))
    preempted(nodes, storage, skew_s)
    node1, outcomes = NodeJob(nodes[1].root), []

    def keeper_of_node_1() -> None:
        for step in (9, 8):  # the flagged step it began with, then the one rank 0's node requests
            try:
                outcomes.append(node1.persist_step(storage, step, WORLD, "keeper", ranks=[1]))
            except Exception as err:
                outcomes.append(err)

    thread = threading.Thread(target=keeper_of_node_1)
    thread.start()
    deadline = time.monotonic() + 30
    while (stage.cursor(storage, 1) or {}).get("step") != 9:
        assert time.monotonic() < deadline, "rank 1's keeper never began step 9"
        time.sleep(0.05)
    said = NodeJob(nodes[0].root).save_on_failure(storage.url, world_size=WORLD, quiet=True)
    thread.join(30)
    assert said["persisted"] and said["step"] == 8, said
    assert isinstance(outcomes[0], stage.Abandoned), outcomes
    assert isinstance(outcomes[1], dict) and storage.latest() == 8 and storage.verify(8) == [], outcomes
    with pytest.raises(stage.Abandoned):  # met again after the save (a copy that ended late): at once
        node1.persist_step(storage, 9, WORLD, "keeper", ranks=[1])

    # Restarted from step 8, both ranks redo step 9: another snapshot, of the next execution.
    for rank in range(WORLD):
        snapshot(nodes[rank], rank, [9], epoch=EPOCH + 1)
    dead_cursor, redone = stage.cursor(storage, 1), []
    thread = threading.Thread(target=lambda: redone.append(node1.persist_step(storage, 9, WORLD, "keeper", [1])))
    thread.start()  # rank 1's keeper first: the stage still holds its dead-end table of step 9
    while stage.cursor(storage, 1) == dead_cursor and thread.is_alive():
        time.sleep(0.05)
    time.sleep(0.5)
    assert thread.is_alive(), "the redone step was given up as the dead end"
    NodeJob(nodes[0].root).persist_step(storage, 9, WORLD, "keeper", [0])
    thread.join(30)
    assert redone and storage.latest() == 9 and storage.verify(9) == [], redone


def test_a_save_on_failure_while_a_worker_of_rank_0s_node_still_runs_declares_and_settles_nothing(nodes, tmp_path):
    """A sibling of the rank that died may still publish a newer step: that save is not final (the agent's
    save after it stops the workers is), so it neither declares the failure nor tells a waiting node."""
    storage = Storage(str(tmp_path / "ckpt"))
    preempted(nodes, storage)
    assert [isinstance(m, dict) for m in run_nodes(nodes, storage, 8)] == [True, True]
    sibling = NodeJob(nodes[0].root).attach()  # a worker still attached on rank 0's node
    try:
        said = NodeJob(nodes[0].root).save_on_failure(storage.url, world_size=WORLD, quiet=True)
        assert said["step"] == 8, said
        assert stage.settled(storage, EPOCH) is None and stage.get(storage, ".stage", "failure.json") is None
    finally:
        os.close(sibling)
    NodeJob(nodes[0].root).save_on_failure(storage.url, world_size=WORLD, quiet=True)  # the final one
    assert stage.settled(storage, EPOCH)["step"] == 8
    assert stage.get(storage, ".stage", "failure.json")["newest"] == 8


def test_a_relaunch_forgets_the_earlier_launchs_failure_and_settle_records(nodes, tmp_path):
    """A requeued or relaunched job's rendezvous rounds start at 0 again, while storage still holds the
    earlier launch's records (execution EPOCH): left, every snapshot of the new launch above step 8 would
    be a dead end, and its first preemption would read "settled" at once. Rank 0 removes them before its
    first restore; an earlier execution's records within one launch stay."""
    storage = Storage(str(tmp_path / "ckpt"))
    stage.declare_failure(storage, EPOCH, 8)
    stage.settle(storage, EPOCH, 8, "the earlier launch's save")
    assert stage.dead_end(storage, 12, 0) is not None and stage.settled(storage, 0) is not None
    assert stage.forget_records_from(storage, 0) == ["failure.json", "settled.json"]
    assert stage.dead_end(storage, 12, 0) is None and stage.settled(storage, 0) is None

    stage.declare_failure(storage, 1, 8)  # this launch's execution 1 failed; execution 2 restores
    stage.settle(storage, 1, 8, "execution 1's save")
    assert stage.forget_records_from(storage, 2) == []
    assert stage.dead_end(storage, 12, 1) is not None and stage.settled(storage, 1)["step"] == 8

    # A node's execution is its workers' (job.json), not that of a snapshot restored from the earlier launch.
    snapshot(nodes[0], 0, [4], epoch=EPOCH)
    job = {"storage": storage.url, "world_size": WORLD, "ranks": [0], "epoch": 0}
    atomic_write(nodes[0].job, json.dumps(job).encode())
    assert NodeJob(nodes[0].root).epoch() == 0

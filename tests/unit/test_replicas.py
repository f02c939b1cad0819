"""Peer memory replicas: the wire (real TCP, real snapshots in /dev/shm), who gets the copies, and a
restore that fetches a lost node's rank from a peer's memory over real gloo processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from stalwart.checkpoint import Storage, replicas
from stalwart.checkpoint.keeper_link import KeeperLink
from stalwart.checkpoint.node_job import NodeJob
from stalwart.checkpoint.peer_restore import (
    agreed_steps,
    host_copies,
    invalidate_replicas_after,
    transfers,
    verify_copy,
)
from stalwart.checkpoint.replicas import (
    VERSION,
    ReplicaError,
    ReplicaServer,
    ReplicaStore,
    SlotSource,
    Superseded,
    canonical,
    replica_roots,
    send_copy,
    sign,
    trailer_mac,
)
from stalwart.checkpoint.replicator import ReplicaConfig, Replicator, choose_peers
from stalwart.checkpoint.shm import JobPaths, atomic_write, complete_slots
from stalwart.checkpoint.snapshot import SnapshotView, SnapshotWriter
from stalwart.checkpoint.state import TrainingState
from stalwart.checkpoint.storage_health import StorageNews
from stalwart.utils import state_dict_hash

from .gloo_ranks import run_ranks

KEY = b"job-token"


@pytest.fixture
def shm():
    root = Path("/dev/shm") / f"stalwart-test-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o700)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def model_and_opt(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def snapshot(
    paths: JobPaths, rank: int, world: int, steps: int, seed: int, first: int = 1, trajectory: tuple[int, int] = (0, 0)
) -> str:
    """Train steps ``first``..``steps`` of a seeded model, snapshot each (in ``trajectory``: the epoch and
    the restores before it); the model's hash after the last."""
    model, opt = model_and_opt(seed)
    ts = TrainingState({"model": model, "optim": opt}, rank)
    writer = SnapshotWriter(paths, rank, world, epoch=trajectory[0])
    writer.restores = trajectory[1]
    train_snapshots(model, opt, ts, writer, range(first, steps + 1))
    return state_dict_hash(model.state_dict())


def train_snapshots(model: nn.Module, opt, state: TrainingState, writer: SnapshotWriter, steps, seed_of=None) -> None:
    """Train ``steps`` (inputs seeded by ``seed_of(step)`` if given) and snapshot each with ``writer``."""
    for s in steps:
        if seed_of is not None:
            torch.manual_seed(seed_of(s))
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        assert writer.start(s, state.capture(), persist=False)
        writer.wait()
    writer.close()


def push(server: ReplicaServer, paths: JobPaths, slot, key: bytes = KEY, ranks=None) -> dict:
    """What a keeper does: open the slot in shared memory and send it from there."""
    with SlotSource(paths, slot) as source:
        return send_copy(("127.0.0.1", server.port), key, paths.root.name, ranks or [slot.rank], source)


def serve(root: Path, key: bytes = KEY) -> ReplicaServer:
    root.mkdir(mode=0o700, exist_ok=True)
    return ReplicaServer("127.0.0.1", ReplicaStore(root, key)).start()


@pytest.fixture
def server(shm):
    """Node B's replica server, in B's job directory."""
    srv = serve(shm / "job-nodeB")
    yield srv
    srv.shutdown()
    srv.server_close()


def test_a_pushed_slot_arrives_verified_and_reads_like_the_original(shm, server):
    src = JobPaths(shm / "job-nodeA")
    snapshot(src, 1, 2, steps=2, seed=1)
    newest = complete_slots(src, 1)[0]
    reply = push(server, src, newest)
    assert reply["ok"] and reply["step"] == 2
    [root] = replica_roots(shm / "job-nodeB")
    copy = JobPaths(root)
    [got] = complete_slots(copy, 1)
    assert got.step == 2 and got.header["replica"]["src"] == "job-nodeA"
    assert verify_copy((copy, got)) is None
    assert oct(os.stat(copy.slot(1, got.slot, "bin")).st_mode & 0o777) == "0o600"
    with SnapshotView(src, newest) as a, SnapshotView(copy, got) as b:
        assert set(a.entries) == set(b.entries)
        assert all(torch.equal(a.tensor(k), b.tensor(k)) for k in a.entries)
    # a flipped byte at rest is caught by the CRC32 the receiver recorded
    with open(copy.slot(1, got.slot, "bin"), "r+b") as f:
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    assert "CRC32" in (verify_copy((copy, got)) or "")
    os.truncate(copy.slot(1, got.slot, "bin"), got.header["data_bytes"] - 1)  # and so is a truncated one
    assert "CRC32" in (verify_copy((copy, got)) or "")


def test_a_push_with_another_key_cut_short_or_altered_publishes_nothing(shm, server):
    src = JobPaths(shm / "job-nodeA")
    snapshot(src, 0, 2, steps=1, seed=0)
    newest = complete_slots(src, 0)[0]
    with pytest.raises(ReplicaError, match="not signed with this job's key"):
        push(server, src, newest, key=b"another-jobs-token")
    # a connection that dies after the header and part of the data (the sender's node died)
    header = json.loads(src.slot(0, newest.slot, "json").read_bytes())
    msg = {"v": VERSION, "src": "job-nodeA", "rank": 0, "ranks": [0], "header": header}
    msg.update(bin_bytes=header["data_bytes"], obj_bytes=10)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(canonical({**msg, "mac": sign(KEY, msg)}) + b"\n" + b"x" * 100)
        sock.shutdown(socket.SHUT_WR)
        answers = sock.makefile("rb")
        assert json.loads(answers.readline())["ready"]
        reply = json.loads(answers.readline())
    assert not reply["ok"] and "connection closed" in reply["error"]
    # bytes changed on the way, or a recorded push replayed: neither matches what the sender signed
    with SlotSource(src, newest) as source:
        data, objects = src.slot(0, newest.slot, "bin").read_bytes()[: source.size], source.objects
    msg.update(bin_bytes=len(data), obj_bytes=len(objects))
    line = canonical({**msg, "mac": sign(KEY, msg)})
    tampered = bytearray(data)
    tampered[0] ^= 0xFF
    for sent, replayed in ((bytes(tampered), False), (data, True)):
        with socket.create_connection(("127.0.0.1", server.port)) as sock, sock.makefile("rb") as answers:
            sock.sendall(line + b"\n")
            nonce = json.loads(answers.readline())["nonce"]
            signed_for = "an earlier push's nonce" if replayed else nonce
            trailer = {"mac": trailer_mac(KEY, line, signed_for, zlib.crc32(data))}
            sock.sendall(sent + objects + json.dumps(trailer).encode() + b"\n")
            reply = json.loads(answers.readline())
        assert not reply["ok"] and "CRC32 the sender signed" in reply["error"]
    assert all(not complete_slots(JobPaths(r), 0) for r in replica_roots(shm / "job-nodeB"))
    assert server.store.received == 0 and server.store.refused == 4


@pytest.mark.parametrize("while_", ["read", "sent"])
def test_a_slot_overwritten_while_it_is_read_or_sent_is_superseded_and_never_published(
    shm, server, monkeypatch, while_
):
    src = JobPaths(shm / "job-nodeA")
    snapshot(src, 0, 2, steps=1, seed=0)
    newest = complete_slots(src, 0)[0]
    real = replicas.header_version
    checks: list[object] = []

    def overwritten_meanwhile(path):  # the writer snapshots two more steps while the bytes are read or sent
        checks.append(path)
        if len(checks) == (2 if while_ == "read" else 3):  # the checks: open, read, after the send
            snapshot(src, 0, 2, steps=2, seed=5)
        return real(path)

    monkeypatch.setattr(replicas, "header_version", overwritten_meanwhile)
    with pytest.raises(Superseded):
        push(server, src, newest)
    # read: nothing sent; sent: cut off before its trailer, so the receiver refuses what it got (on its
    # own thread, which may finish after the sender has raised)
    refused = 1 if while_ == "sent" else 0
    deadline = time.monotonic() + 10
    while server.store.refused < refused and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (server.store.received, server.store.refused) == (0, refused)
    assert all(not complete_slots(JobPaths(r), 0) for r in replica_roots(shm / "job-nodeB"))
    # the newer snapshot goes through, with the newer bytes
    newer = complete_slots(src, 0)[0]
    assert newer.step == 2 and push(server, src, newer)["step"] == 2
    assert server.store.received == 1


def test_copies_go_round_the_ring_other_failure_domains_first():
    nodes = [{"node": n, "domain": d} for n, d in [("a", "r1"), ("b", "r1"), ("c", "r2"), ("d", "r2")]]
    order = lambda me, dom, down=(): [e["node"] for e in choose_peers(me, dom, nodes, set(down))]
    assert order("b", "") == ["c", "d", "a"]  # the next nodes after b, wrapping round
    assert order("b", "r1") == ["c", "d", "a"]
    assert order("c", "r2") == ["a", "b", "d"]  # rack r2's other node last
    assert order("a", "", down=["b"]) == ["c", "d"]  # a node that failed recently is skipped (5 s)
    # every node's first choice differs: no node holds everyone's copies
    assert len({order(n["node"], "")[0] for n in nodes}) == 4


def test_replica_settings_come_from_the_agent():
    assert ReplicaConfig.from_env({}) is None
    assert ReplicaConfig.from_env({"STALWART_REPLICAS": "0", "STALWART_REPLICA_KEY": "t"}) is None
    assert ReplicaConfig.from_env({"STALWART_REPLICAS": "2"}) is None  # no token: nothing to sign with
    c = ReplicaConfig.from_env({"STALWART_REPLICAS": "2", "STALWART_REPLICA_KEY": "t", "STALWART_REPLICA_DOMAIN": "r"})
    assert c == ReplicaConfig(2, "127.0.0.1", "r", b"t")
    sync = {"STALWART_REPLICAS": "1", "STALWART_REPLICA_KEY": "t", "STALWART_REPLICA_SYNC": "1"}
    assert ReplicaConfig.from_env(sync).sync and not c.sync


def test_the_plan_fetches_only_what_a_host_lacks():
    # world 3: rank 1 (node C, formerly rank 2) and rank 2 (a spare, empty) lack their copies of step 9;
    # rank 0's host holds rank 1's replica, rank 1's host its old rank 2 directory
    tables = [{0: [8, 9], 1: [8, 9]}, {1: [7], 2: [8, 9]}, {}]
    assert agreed_steps(tables, 3) == {8, 9}
    assert transfers(tables, 9, 3) == [(0, 1), (1, 2)]
    assert agreed_steps([{0: [9]}, {1: [9]}], 3) == set()  # nobody holds rank 2
    assert transfers([{0: [9]}, {1: [9]}], 9, 2) == []


WORKER = r"""
import json, sys, torch, torch.distributed as dist
from pathlib import Path
from torch import nn
from stalwart.checkpoint.restore import restore_state
from stalwart.checkpoint.shm import JobPaths
from stalwart.checkpoint.state import TrainingState
from stalwart.utils import state_dict_hash
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(100 + rank)  # not the trained weights: the restore must bring them
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
info = restore_state(TrainingState({"model": model, "optim": opt}, rank), JobPaths(sys.argv[rank + 1]), None, rank, 3)
print(json.dumps({"rank": rank, "hash": state_dict_hash(model.state_dict()), "info": info.as_dict()}), flush=True)
dist.destroy_process_group()
"""


def node_dies_after_pushing(node: JobPaths, rank: int, peer: JobPaths) -> None:
    """``node``'s keeper pushed its rank's snapshots to ``peer``; then the node dies with its memory."""
    server = serve(peer.root)
    try:
        for s in complete_slots(node, rank):
            push(server, node, s)
    finally:
        server.shutdown()
        server.server_close()
    shutil.rmtree(node.root)


def test_a_lost_nodes_rank_is_restored_from_a_peers_memory_after_the_ranks_moved(shm, tmp_path):
    # Before: nodes A, B, C hold ranks 0, 1, 2 (steps 1-3); B's keeper pushed its rank 1 to A.
    a, b, c, d = (JobPaths(shm / f"job-node{n}") for n in "ABCD")
    hashes = {r: snapshot(p, r, 3, steps=3, seed=r) for r, p in enumerate((a, b, c))}
    node_dies_after_pushing(b, 1, a)
    d.root.mkdir(mode=0o700)  # the spare D joins empty; TorchElastic orders A, C, D as ranks 0, 1, 2
    assert sorted(host_copies(a, 3)) == [0, 1] and sorted(host_copies(c, 3)) == [2] and not host_copies(d, 3)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    for rank, row in run_ranks(script, 3, [str(a.root), str(c.root), str(d.root)]).items():
        assert row["info"]["source"] == "memory" and row["info"]["step"] == 3, row
        assert "2 rank(s) fetched from peers' memory" in row["info"]["detail"]
        assert row["hash"] == hashes[rank], f"rank {rank} did not get its own state back"
    assert not (c.root / "fetched").exists() and not (d.root / "fetched").exists()  # transfer files removed


def test_a_third_slot_keeps_two_older_snapshots_and_the_oldest_is_overwritten(shm):
    paths = JobPaths(shm / "job-nodeA")
    model, opt = model_and_opt(0)
    ts = TrainingState({"model": model, "optim": opt}, 0)
    writer = SnapshotWriter(paths, 0, 2, slots=3)
    for s in range(1, 6):
        assert writer.start(s, ts.capture(), persist=False)
        writer.wait()
        assert [x.step for x in complete_slots(paths, 0)] == list(range(s, max(0, s - 3), -1))
    writer.close()
    with pytest.raises(ValueError, match="2 to 3 slots"):
        SnapshotWriter(paths, 0, 2, slots=4)


def test_a_copy_taken_before_a_restore_is_refused_and_silent_sources_are_freed(shm, server):
    src = JobPaths(shm / "job-nodeA")
    snapshot(src, 0, 2, steps=3, seed=0)
    push(server, src, complete_slots(src, 0)[0])  # step 3 arrives: B now holds A's copies
    old_step_2 = complete_slots(src, 0)[1]
    # B's ranks restore step 1 (a rollback within execution 0, its first restore): A's step-2 snapshot,
    # still in flight, is the old trajectory, whatever time its header says (the nodes' clocks may differ)
    invalidate_replicas_after(JobPaths(shm / "job-nodeB"), 1, (0, 1))
    [root] = replica_roots(shm / "job-nodeB")
    assert not complete_slots(JobPaths(root), 0), "the copy of step 3 is forgotten"
    with pytest.raises(ReplicaError, match="taken before this host restored step 1"):
        push(server, src, old_step_2)
    snapshot(src, 0, 2, steps=2, seed=0, trajectory=(0, 1))  # the new trajectory's step 2, after the restore
    assert push(server, src, complete_slots(src, 0)[0])["step"] == 2
    assert server.store.prune_silent(3600) == [] and server.store.prune_silent(0) == [root.name]
    assert not root.exists()


def test_replicas_are_off_for_a_job_that_cannot_span_nodes():
    from stalwart.launch.run_args import build_parser, replica_sync, replicas

    parse = lambda *a: build_parser().parse_args([*a, "train.py"])
    assert replicas(parse("--nnodes", "1")) == 0 and replicas(parse("--standalone")) == 0
    assert replicas(parse("--nnodes", "1:4")) == 1 and replicas(parse("--nnodes", "4", "--replicas", "2")) == 2
    with pytest.raises(ValueError, match="--replicas must be 0"):
        replicas(parse("--nnodes", "2", "--replicas", "-1"))
    assert replica_sync(parse("--nnodes", "2", "--replica-sync")) == "1" and replica_sync(parse("--nnodes", "2")) == ""
    assert replica_sync(parse("--nnodes", "2", "--replica-overlap")) == "overlap"
    assert replica_sync(parse("--nnodes", "1", "--replica-sync")) == ""  # nothing to wait for on one node
    with pytest.raises(ValueError, match="--replica-overlap waits .* give --replicas ≥ 1"):
        replica_sync(parse("--nnodes", "2", "--replicas", "0", "--replica-overlap"))
    with pytest.raises(ValueError, match="give one"):
        replica_sync(parse("--nnodes", "2", "--replica-sync", "--replica-overlap"))


def two_nodes(shm: Path, storage: Storage) -> tuple[NodeJob, NodeJob]:
    """Node A holds rank 0 and node B rank 1 of a 2-rank job; their keepers meet through ``storage``."""
    out = []
    for name, rank in (("nodeA", 0), ("nodeB", 1)):
        node = NodeJob(shm / f"job-{name}")
        node.paths.rank_dir(rank).mkdir(parents=True)
        atomic_write(node.paths.owner(rank), json.dumps({"rank": rank, "world_size": 2}).encode())
        node.write_job(storage, 2, [rank], {}, keeper=True, keeper_log=None)
        out.append(node)
    return out[0], out[1]


def test_with_replica_sync_a_save_returns_once_its_copy_is_on_a_peer_and_goes_on_without_one(shm, tmp_path):
    a, b = two_nodes(shm, Storage(str(tmp_path / "ckpt")))
    config = ReplicaConfig(1, "127.0.0.1", "", KEY, sync=True)
    sender, receiver = Replicator(a, config), Replicator(b, config)
    link = KeeperLink(a, 0, 0, by_agent=True, log_path=None, timeout_s=60, storage_news=StorageNews("", False))
    try:
        deadline = time.monotonic() + 10
        while not sender._candidates():  # the keepers meet through the registry (read every 2 s)
            assert time.monotonic() < deadline, "node A never learned of node B"
            time.sleep(0.05)
        since = time.time()
        snapshot(a.paths, 0, 2, steps=3, seed=0)
        assert link.wait_replicated(3, since) is None
        [root] = replica_roots(b.root)  # the copy is on B when the wait returns, not some time later
        assert 3 in {s.step for s in complete_slots(JobPaths(root), 0)}
        assert link.await_copies(3, since) is True  # what makes the step safe (Checkpointer.safe_step)
        # news from before a snapshot began is about an older one: a later save does not take it
        assert link.wait_replicated(3, time.time(), timeout_s=0.3) == "timeout"
        receiver.stop()  # B is gone: the next step gets no copy, and the save says so at once
        since = time.time()
        snapshot(a.paths, 0, 2, steps=4, seed=0, first=4)
        why = link.wait_replicated(4, since)
        assert why in ("no peer", "no peer took the copy"), why
        assert link.await_copies(4, since) is False  # no step is called safe without its copy
        sender.stop()  # no replicator: nobody will copy, and nobody waits for a copy
        assert link.wait_replicated(5, time.time()) == "the keeper's replicator is not running"
    finally:
        sender.stop()
        receiver.stop()


def test_safe_step_is_the_step_every_rank_confirmed_and_a_failed_confirmation_clears_it():
    """Checkpointer.safe_step: a step whose copies a rank could not confirm (no peer took it, or a rank
    skipped its snapshot) leaves no older step called safe — its copies may since be overwritten."""
    from types import SimpleNamespace

    from stalwart.checkpoint.checkpointer import Checkpointer

    answers = iter([True, False, True])  # the keeper's word on steps 3, 4 and 6 (5 was not snapshotted)
    ck = SimpleNamespace(
        writer=SimpleNamespace(wait=lambda: None),
        group=None,
        keeper=SimpleNamespace(await_copies=lambda step, since: next(answers)),
        stats={"replica_wait_s": 0.0},
        safe_step=None,
    )
    for step, started, safe in ((3, True, 3), (4, True, None), (5, False, None), (6, True, 6)):
        Checkpointer._wait_for_copies(ck, step, 0.0, started)
        assert ck.safe_step == safe, (step, ck.safe_step)

"""Peer memory replicas under FSDP2 (issue 16): a 2-node job with a spare loses a whole node — agent,
worker, keeper and its shared memory — and the survivor and the spare resume from memory: the lost
rank's FSDP2 shards come from the copy its keeper pushed into the survivor's memory (`--replicas 1`,
the default), not from storage. The final weights and optimizer state are bitwise those of a
fault-free 2-rank FSDP2 run. With `--replica-sync` the node is killed at once, and no step the
survivor completed is lost; with `--replica-overlap` (the copies overlap the next step) at most one, and
never one that a step's record called safe (``safe_step``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from stalwart.checkpoint import Storage
from stalwart.launch.client import MasterClient
from stalwart.launch.progress import ProgressReader

from . import test_elastic
from .test_elastic import Pace, lose_node, start_master, start_node
from .test_master import TOKEN
from .test_spares import caught_up, copying, same_as_reference, stop_job, wait_for

pytestmark = pytest.mark.e2e
STEPS = 40
FSDP = ("--parallel.dp_mode=fsdp", f"--train.steps={STEPS}")


@pytest.fixture(scope="module")
def reference(stdlib_data, tmp_path_factory):
    """The fault-free 2-rank FSDP2 run both tests compare with, started once: it runs beside the first
    test's job, the second finds it done. Yields its directory and process."""
    out = tmp_path_factory.mktemp("reference")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stalwart", "train", "--nproc", "2", *test_elastic.train_args(stdlib_data, out), *FSDP],
        stdout=subprocess.DEVNULL,
        stderr=open(out / "reference.log", "w"),
    )
    yield out, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def completed_step(tmp_path, n: int) -> int:
    """The newest step node n's rank reported (after its checkpoint call: the trainer reports last)."""
    reader = ProgressReader(tmp_path / f"run{n}" / "progress" / f"node{n}")
    return max((p.step for r in (0, 1) if (p := reader.read(r)) is not None), default=0)


WAITS = {"async": (), "sync": ("--replica-sync",), "overlap": ("--replica-overlap",)}


@pytest.mark.parametrize("wait", list(WAITS))
def test_a_lost_nodes_fsdp2_shards_come_back_from_a_peers_memory_bitwise(stdlib_data, tmp_path, wait, reference):
    job = f"replicas-{uuid.uuid4().hex[:8]}"
    master, address = start_master(tmp_path)
    client = MasterClient(address, TOKEN)
    reference_dir, reference_run = reference
    # 40 steps at ≥ 0.2 s until the kill: time to see the round, its commit and act mid-run; after it
    # the job cannot go on before it regrouped, and it trains the rest at full speed
    pace = Pace(tmp_path / "pace", 0.2)
    nodes: dict[int, subprocess.Popen] = {}
    try:
        for n in range(3):
            run = ("--summary-json", str(tmp_path / f"summary{n}.json"), *WAITS[wait])
            nodes[n] = start_node(tmp_path, stdlib_data, address, job, n, run=run, train=FSDP, pace=pace)
        wait_for(
            "a round and a spare",
            lambda: (len(client.status()["members"]), len(client.status()["spares"])) == (2, 1),
            nodes,
            tmp_path,
        )
        storage = Storage(str(tmp_path / "ckpt"))
        wait_for("a committed step", lambda: (storage.latest() or 0) >= 10, nodes, tmp_path, timeout=180)
        members = sorted(client.status()["members"])
        lost = int(members[1][-1])
        # its keeper copies to a peer by then (peers meet through storage: under load 9 a node killed
        # before, with --replica-sync, had nothing in the survivor's memory and restored from storage)
        wait_for(f"node{lost}'s copies", copying(job, lost, storage), nodes, tmp_path)
        time.sleep(0.5)  # a step or two past the commit: storage alone would lose them
        committed = storage.latest() or 0
        survivor = int(members[0][-1])
        done = completed_step(tmp_path, survivor)
        # Asynchronous copies trail the steps (under load by more than the survivor's slots): killed the
        # moment they are within them. With --replica-sync or --replica-overlap, at once.
        t_kill = time.time()
        lose_node(nodes[lost], job, lost, when=caught_up(job, lost, survivor, world=2) if wait == "async" else None)
        pace.set(0)
        for n in (n for n in nodes if n != lost):
            assert nodes[n].wait(timeout=240) == 0, (tmp_path / f"node{n}.log").read_text()[-4000:]
        assert reference_run.wait(timeout=240) == 0, (reference_dir / "reference.log").read_text()[-3000:]
    finally:
        stop_job(nodes, job, None, master)

    ck = same_as_reference(tmp_path, STEPS, reference_dir)["checkpoint"]
    assert ck["restored_from"] == "memory" and ck["restore_step"] >= committed, (ck, committed)
    assert "1 rank(s) fetched from peers' memory" in ck["restore_detail"], ck
    assert (ck["replica_wait_s"] > 0) == (wait != "async"), ck  # only these make the steps wait for copies
    if wait == "sync":  # every step completed before the kill had its copies out: none is redone
        assert ck["restore_step"] >= done, (ck, done)
    if wait == "overlap":  # every step but the last completed one had its copies out
        assert ck["restore_step"] >= done - 1, (ck, done)
    # safe_step: every rank's copy of it was out when its step's record was made (sync: the step's own,
    # overlap: the one before); none is said without a wait. The restore never goes behind one said.
    lag = {"async": None, "sync": 0, "overlap": 1}[wait]
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines() if x.startswith("{")]
    safe = [(r["step"], r["safe_step"]) for r in rows if "safe_step" in r and r["time"] < t_kill]
    if lag is None:
        assert not any("safe_step" in r for r in rows), rows[-1]
    else:
        assert all(s <= step - lag for step, s in safe) and any(s == step - lag for step, s in safe), safe
        last = max((r for r in rows if r["time"] < t_kill), key=lambda r: r["time"])  # what it was last told
        assert ck["restore_step"] >= last.get("safe_step", 0), (ck, last)

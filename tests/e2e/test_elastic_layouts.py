"""Elastic shrink with a layout change: a TP2 × DP2 job on two nodes (two workers each, `--nnodes 1:2`)
loses a whole node and goes on as TP2 on the node left, from the four ranks' memory snapshots — the
survivor's own and the copies the lost node pushed to it (`--replica-sync`: in step) — resharded from
four ranks to two, newer than the last committed checkpoint, with the global batch unchanged. The
master, its rendezvous store and the node-loss helper are those of test_elastic.py; the model and data
are test_train_layouts.py's (constant learning rate), so the shrunk run is compared with a 1-process
run step by step.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stalwart.checkpoint import Storage
from stalwart.launch.journal import Journal

from .test_elastic import agent_cmd, lose_node, start_master
from .test_spares import pushed_step
from .test_train_layouts import COMMON, RTOL, train

pytestmark = pytest.mark.e2e
STEPS, BATCH, WORKERS = 10, 8, 2  # BATCH: test_train_layouts' global batch


def start_node(tmp_path: Path, data: Path, address: str, job: str, n: int) -> subprocess.Popen:
    """One node of the TP2 job: an agent with two workers; dp is whatever the ranks allow (2, then 1)."""
    cmd = [
        *agent_cmd(tmp_path, address, job, n, nproc=WORKERS, slow_s=0.2),
        "--replica-sync",
        "-m",
        "stalwart",
        "train",
        *COMMON,
        f"--data.dir={data}",
        f"--train.steps={STEPS}",
        "--parallel.tp=2",
        f"--train.out_dir={tmp_path / 'out'}",
        "--checkpoint.enabled=true",
        f"--checkpoint.dir={tmp_path / 'ckpt'}",
        "--checkpoint.persist_every_steps=2",
        f"--checkpoint.keep_last={STEPS}",
        "--checkpoint.keeper_idle_s=20",
    ]  # keep the one shrunk from
    return subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"node{n}.log", "w"), start_new_session=True
    )


def node_log(tmp_path: Path, n: int) -> str:
    return (tmp_path / f"node{n}.log").read_text()[-4000:]


def test_losing_a_node_shrinks_tp2_dp2_to_tp2_and_training_continues_on_the_curve(stdlib_data, tmp_path):
    job = f"elastic-tp-{uuid.uuid4().hex[:8]}"
    master, address = start_master(tmp_path)
    nodes = [start_node(tmp_path, stdlib_data, address, job, n) for n in range(2)]
    pool = ThreadPoolExecutor(1)  # the 1-process reference runs while the job waits on rendezvous
    reference = pool.submit(train, tmp_path / "ref", stdlib_data, nproc=1, steps=STEPS)
    try:
        storage = Storage(str(tmp_path / "ckpt"))
        deadline = time.monotonic() + 150
        committed = None
        while committed is None:  # a checkpoint of both nodes' four ranks to shrink from
            assert time.monotonic() < deadline, "no four-rank checkpoint was committed"
            assert all(p.poll() is None for p in nodes), node_log(tmp_path, 0)
            latest = storage.latest()
            manifest = storage.manifest(latest) if latest else None
            committed = latest if manifest and manifest["world_size"] == 2 * WORKERS else None
            time.sleep(0.1)
        assert committed < STEPS - 2, f"the job was nearly done ({committed}) before the node was lost"
        while (pushed_step(job, 1) or 0) <= committed:
            assert time.monotonic() < deadline, "node1 copied no step past the committed one to node0"
            time.sleep(0.05)
        lose_node(nodes[1], job, 1)
        assert nodes[0].wait(timeout=180) == 0, node_log(tmp_path, 0)

        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert summary["world_size"] == WORKERS and summary["steps"] == STEPS
        assert {k: v for k, v in summary["layout"]["degrees"].items() if v > 1} == {"tp": 2}
        # The last start: two ranks, from the four ranks' state the decider saved on the loss — node0's
        # own snapshots and its peer copies of node1's ranks, written from memory to storage — resharded.
        ck = summary["checkpoint"]
        assert ck["restored_from"] == "storage" and ck["restore_step"] > committed, ck
        saved = storage.manifest(ck["restore_step"])
        assert saved["world_size"] == 2 * WORKERS and saved["source"] == "save-on-failure", saved
        # The global batch is unchanged (grad accumulation doubled): every sample of the order once.
        assert summary["samples_consumed"] == STEPS * BATCH and summary["global_batch"] == BATCH
        # Steps redone after the restart are logged again; the later record wins, and every step is there,
        # the restored one too: rank 0's agent stops its workers on the loss, which may come between a
        # step's snapshot and its metrics record; the restart then writes it from the snapshot.
        records = {}
        for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            records[record["step"]] = record
        assert set(records) == set(range(1, STEPS + 1)), (sorted(records), ck)
        assert all(r["samples_consumed"] == s * BATCH for s, r in records.items())
        ref = reference.result()["losses"]  # on the 1-process curve before and after the shrink
        for s, r in records.items():
            assert abs(r["loss"] - ref[s - 1]) <= RTOL * abs(ref[s - 1]), f"step {s}: {r['loss']} vs {ref[s - 1]}"
        decisions = Journal(tmp_path / "journal.sqlite").decisions()
        assert any(d["action"] == "node_lost" and d["details"]["node_id"] == "node1" for d in decisions)
    finally:
        for n, p in enumerate(nodes):
            if p.poll() is None:
                lose_node(p, job, n)
        master.terminate()
        master.wait(10)
        pool.shutdown()

"""Flash checkpoints across nodes without a master every node shares: plain ``torchrun`` (no master at
all) and ``stalwart run`` without ``--master`` (a master per node, which hears its own node only). Rank
0's keeper hosts the checkpoint decider and the other keepers find it in the workers' rendezvous store
(``checkpoint/desk_host.py``): each node writes its own rank's shards, storage holds checkpoints only,
and a worker killed mid-run is saved on failure and resumed bitwise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.checkpoint import Storage
from stalwart.utils.ports import free_port

from .test_ckpt_multinode import STEPS, finished, train_job

pytestmark = pytest.mark.e2e


def run_two_nodes(tmp_path: Path, data: Path, launcher: str, chaos: str | None = None) -> dict:
    port = free_port()
    train = train_job(tmp_path, data, keeper_idle_s=5)
    procs = []
    for n in range(2):
        shm = tmp_path / f"shm{n}"  # each "node" its own tmpfs, as separate hosts would have
        shm.mkdir()
        env = {**os.environ, "STALWART_SHM_DIR": str(shm), "STALWART_CHAOS_DIR": str(tmp_path / "chaos")}
        env.pop("STALWART_CHAOS", None)
        if launcher == "torchrun":
            if chaos:
                env["STALWART_CHAOS"] = chaos
            # torch's own fault (docs/gpu.md): restarted gloo workers read their predecessors' addresses
            # from a store shared across rounds; `stalwart run` sets this for its workers too.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            head = ["-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
            head += ["--rdzv-id", f"ml{port}", "--max-restarts", "1"]
        else:
            head = ["-m", "stalwart", "run", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
            head += ["--rdzv-id", f"ml{port}", "--node-id", f"node{n}", "--max-restarts", "2"]
            head += ["--run-dir", str(tmp_path / f"run{n}"), *(["--chaos", chaos] if chaos else [])]
        cmd = [sys.executable, *head, "--nnodes", "2", "--nproc-per-node", "1", *train]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
    return finished(procs, tmp_path)


@pytest.fixture(scope="module")
def reference(stdlib_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("ml-ref")
    return run_two_nodes(out, stdlib_data, "torchrun")


@pytest.mark.parametrize("launcher", ["torchrun", "stalwart-run"])
def test_rank0s_keeper_decides_and_each_node_writes_its_shards(stdlib_data, tmp_path, reference, launcher):
    summary = run_two_nodes(tmp_path, stdlib_data, launcher)
    assert summary["final_hash"] == reference["final_hash"]
    storage = Storage(str(tmp_path / "ckpt"))
    assert storage.latest() == STEPS and storage.verify(STEPS) == []
    manifest = storage.manifest(STEPS)
    writers = {name.split("_")[3] for name in manifest["files"] if name.endswith(".distcp")}
    assert manifest["world_size"] == 2 and writers == {"0", "1"}, sorted(manifest["files"])
    assert not (tmp_path / "ckpt" / ".stage").exists(), "storage holds checkpoints only"
    log = (tmp_path / "out" / "keeper.log").read_text()
    assert len(re.findall(r"the checkpoint decider is hosted here, at http://", log)) == 1, log[-3000:]
    assert len(re.findall(r"the checkpoint decider is rank 0.s keeper.s, at http://", log)) == 1, log[-3000:]
    done = {int(s) for s in re.findall(r"keeper\[\d+\] INFO committed step (\d+):", log)}
    assert STEPS in done and done <= {4, 8, 12}, log[-3000:]
    left = [p for n in range(2) for p in (tmp_path / f"shm{n}").glob("stalwart-*/*")]
    assert not left, f"the job's snapshots are gone at its end: {left}"


def test_a_killed_worker_is_saved_on_failure_and_resumed_bitwise(stdlib_data, tmp_path, reference):
    summary = run_two_nodes(tmp_path, stdlib_data, "torchrun", "kill:rank=1:step=6")
    assert summary["final_hash"] == reference["final_hash"] and summary["optim_hash"] == reference["optim_hash"]
    assert summary["samples_consumed"] == reference["samples_consumed"]
    manifest = Storage(str(tmp_path / "ckpt")).manifest(6)  # not due (every 4): only the save on failure
    log = (tmp_path / "out" / "keeper.log").read_text()
    assert manifest is not None and manifest["source"] == "save-on-failure", log[-3000:]
    assert manifest["world_size"] == 2


def test_nodes_whose_agents_counted_the_restart_differently_form_the_next_execution(stdlib_data, tmp_path, reference):
    # Rank 1 is killed after step 6 while rank 0 sleeps outside any collective: node 1's agent counts a
    # restart (its worker failed), node 0's restarts its healthy worker for the membership change and
    # counts none — TORCHELASTIC_RESTART_COUNT 1 and 0 in the next execution. Its epoch must still be
    # one on both nodes, or the decider never sees it form and nothing after the restart is persisted.
    chaos = "kill:rank=1:step=6;delay:rank=0:step=6:seconds=30:once=1"
    summary = run_two_nodes(tmp_path, stdlib_data, "torchrun", chaos)
    assert summary["final_hash"] == reference["final_hash"] and summary["optim_hash"] == reference["optim_hash"]
    log = (tmp_path / "out" / "keeper.log").read_text()
    assert "[epoch 1] epoch 1 began with nodes" in log or "epoch 1 formed with nodes" in log, log[-3000:]
    storage = Storage(str(tmp_path / "ckpt"))
    assert storage.latest() == STEPS and storage.verify(STEPS) == [], log[-3000:]
    assert storage.manifest(6)["source"] == "save-on-failure", log[-3000:]

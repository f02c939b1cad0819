"""Tier 2 and restore with real processes: kill during copy, save-on-failure after SIGKILL, kill
during persist, corrupt shards, retention, the keeper's coalescing, plain DCP load and the CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from stalwart.checkpoint import Checkpointer, NodeJob, Storage, job_dir_for, save_on_failure
from stalwart.checkpoint.persist import retention
from stalwart.checkpoint.shm import JobPaths, complete_slots, read_json, user_dir
from stalwart.utils import state_dict_hash
from stalwart.utils.ports import free_port

WORKER = r"""
import argparse, json, os, torch, torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from stalwart import chaos
from stalwart.checkpoint import Checkpointer
from stalwart.utils import state_dict_hash

p = argparse.ArgumentParser()
p.add_argument("out"); p.add_argument("ckdir"); p.add_argument("shm"); p.add_argument("steps", type=int)
p.add_argument("--no-close", action="store_true")
a = p.parse_args()
ddp = "WORLD_SIZE" in os.environ
if ddp:
    dist.init_process_group("gloo")
rank = dist.get_rank() if ddp else 0
torch.manual_seed(rank)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
if ddp:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
extra = {"step": 0}
state = {"model": model, "optim": opt, "extra": extra}
ck = Checkpointer(a.ckdir, keeper=False, shm_root=a.shm)
start = ck.restore(state)
log = open(f"{a.out}/rank{rank}.jsonl", "a")
log.write(json.dumps({"restored": ck.last_restore.as_dict()}) + "\n"); log.flush()
for step in range(start + 1, a.steps + 1):
    model(torch.randn(8, 16)).pow(2).mean().backward()  # torch RNG: the restored state matters
    opt.step(); opt.zero_grad()
    extra["step"] = step
    h = state_dict_hash(get_model_state_dict(model))
    log.write(json.dumps({"step": step, "hash": h}) + "\n"); log.flush()
    ck.save(step, state)
    if fault := chaos.due("step", step=step, rank=rank):
        ck.wait_node_holds(step); fault.fire()  # as the trainer: every rank's snapshot of step is whole
ck.wait()
if a.no_close:
    os._exit(0)
ck.close()
from stalwart.runtime import exit_process  # a gloo user's end (see exit_process); as stalwart's workers end
exit_process(0)
"""


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Worker script, private shm root and chaos marker dir; kills keepers and removes shm after."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    shm = Path("/dev/shm") / f"stalwart-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    monkeypatch.setenv("STALWART_CHAOS_DIR", str(tmp_path / "chaos"))
    monkeypatch.delenv("STALWART_CHAOS", raising=False)
    yield {"script": script, "shm": shm, "ck": tmp_path / "ck", "out": tmp_path}
    for status in user_dir(shm).glob("*/keeper.json"):
        _kill(read_json(status))
    shutil.rmtree(shm, ignore_errors=True)


def _kill(status: dict | None) -> None:
    if status and status.get("pid"):
        try:
            os.kill(int(status["pid"]), signal.SIGKILL)  # a keeper this test started
        except ProcessLookupError:
            pass


def run_worker(env, steps, *flags, chaos="", world=1, timeout=120):
    base = dict(os.environ, STALWART_CHAOS=chaos)
    cmd = [sys.executable, str(env["script"]), str(env["out"]), str(env["ck"]), str(env["shm"]), str(steps), *flags]
    if world == 1:
        return [subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=base)]
    port = free_port()
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(
                base,
                RANK=str(r),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
        )
        for r in range(world)
    ]
    return procs


def records(env, rank=0):
    return [json.loads(line) for line in (env["out"] / f"rank{rank}.jsonl").read_text().splitlines()]


def job_paths(env) -> JobPaths:
    return JobPaths(job_dir_for(str(env["ck"]), env["shm"]))


def net():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))


def test_kill_during_copy_resumes_from_previous_snapshot_bitwise(env, tmp_path):
    ref = dict(env, out=tmp_path / "ref", ck=tmp_path / "ref-ck")
    ref["out"].mkdir()
    assert run_worker(ref, 5)[0].returncode == 0
    reference = {r["step"]: r["hash"] for r in records(ref) if "step" in r}

    killed = run_worker(env, 5, chaos="kill:at=copy:step=3")[0]
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [s.step for s in complete_slots(job_paths(env), 0)] == [2]  # step 3 (over step 1) torn, 2 intact

    resumed = run_worker(env, 5)[0]
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    info = [r for r in records(env) if "restored" in r][-1]["restored"]
    assert (info["source"], info["step"]) == ("memory", 2)
    final = [r for r in records(env) if "step" in r][-1]
    assert final == {"step": 5, "hash": reference[5]}


def test_save_on_failure_persists_the_step_all_ranks_hold(env):
    procs = run_worker(env, 6, chaos="kill:rank=1:step=3", world=2)
    assert procs[1].wait(60) == -signal.SIGKILL
    procs[0].send_signal(signal.SIGKILL)  # as an agent would: the survivor is stuck in a collective
    procs[0].wait()
    paths = job_paths(env)
    hashes = {r["step"]: r["hash"] for r in records(env, 0) if "step" in r}
    assert sorted(s.step for s in complete_slots(paths, 1)) == [2, 3]

    newest = paths.slot(1, complete_slots(paths, 1)[0].slot, "json")
    newest.rename(newest.with_suffix(".hidden"))  # rank 1 lacks step 3: only step 2 is agreed
    result = save_on_failure(paths.root)
    assert result["persisted"] and result["step"] == 2
    older = paths.slot(1, complete_slots(paths, 1)[0].slot, "json")
    older.rename(older.with_suffix(".hidden2"))
    result = save_on_failure(paths.root)
    assert not result["persisted"] and "do not agree" in result["detail"] and "rank 1: none" in result["detail"]
    assert not result["covered"]
    older.with_suffix(".hidden2").rename(older)
    newest.with_suffix(".hidden").rename(newest)

    result = save_on_failure(paths.root)
    assert result["persisted"] and result["step"] == 3
    again = save_on_failure(paths.root)
    assert not again["persisted"] and again["covered"] and again["step"] == 3, again  # the CLI's "ok"
    storage = Storage(str(env["ck"]))
    assert storage.latest() == 3 and storage.committed() == [3, 2]
    model = net()
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=storage.checkpoint_id(3))  # plain DCP reads it
    assert state_dict_hash(sd["model"]) == hashes[3]


def test_kill_during_persist_corrupt_shard_and_cli(env, tmp_path, cli):
    assert run_worker(env, 4, "--no-close")[0].returncode == 0
    hashes = {r["step"]: r["hash"] for r in records(env) if "step" in r}
    paths, storage = job_paths(env), Storage(str(env["ck"]))
    NodeJob(paths.root).persist_step(storage, 3, 1, "test")
    assert storage.latest() == 3

    code = (
        "import sys; from stalwart.checkpoint import NodeJob, Storage; "
        "NodeJob(sys.argv[1]).persist_step(Storage(sys.argv[2]), 4, 1, 'test')"
    )
    died = subprocess.run(
        [sys.executable, "-c", code, str(paths.root), str(env["ck"])],
        capture_output=True,
        text=True,
        env=dict(os.environ, STALWART_CHAOS="kill:at=persist:step=4"),
        timeout=60,
    )
    assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
    assert storage.latest() == 3 and 4 in storage.steps() and storage.committed() == [3]
    ls = json.loads(cli("ckpt", "ls", str(env["ck"]), "--json")[1])
    assert [(c["step"], c["state"]) for c in ls["checkpoints"]] == [(4, "torn"), (3, "committed")]

    NodeJob(paths.root).persist_step(storage, 4, 1, "test")  # the next persist succeeds
    assert storage.latest() == 4 and storage.committed() == [4, 3]
    code, out = cli("ckpt", "verify", str(env["ck"]))
    assert code == 0 and "step 4: ok" in out

    shard = env["ck"] / "step-00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out = cli("ckpt", "verify", str(env["ck"]), "--json")
    assert code == 1
    assert "step-00000004/__0_0.distcp" in json.loads(out)["problems"]["4"][0]

    shutil.rmtree(paths.root)  # no memory snapshot: restore must fall back to storage
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = {"step": 0}
    ck = Checkpointer(str(env["ck"]), keeper=False, shm_root=str(env["shm"]))
    assert ck.restore({"model": model, "optim": opt, "extra": extra}) == 3
    assert any("__0_0.distcp" in s and "CRC32" in s for s in ck.last_restore.skipped)
    assert state_dict_hash(model.state_dict()) == hashes[3] and extra == {"step": 3}
    ck.close()

    shown = json.loads(cli("ckpt", "show", str(env["ck"]), "--step", "3", "--json")[1])
    assert shown["committed"] and shown["groups"]["model"]["tensors"] == 4
    for fmt in ("torch", "safetensors"):
        out = tmp_path / f"model.{fmt}"
        assert cli("ckpt", "export", str(env["ck"]), "--step", "3", "--format", fmt, "--out", str(out))[0] == 0
        if fmt == "torch":
            weights = torch.load(out, weights_only=True)
        else:
            from safetensors.torch import load_file

            weights = load_file(out)
        assert state_dict_hash(weights) == hashes[3]


@pytest.fixture
def cli(capsys):
    """`stalwart ...` in this process (no interpreter start per call): (exit code, stdout)."""
    from stalwart.cli import main

    def run(*args: str) -> tuple[int, str]:
        capsys.readouterr()
        code = main(list(args))
        return code, capsys.readouterr().out

    return run


def test_retention_keeps_last_k_every_m_and_latest(tmp_path):
    storage = Storage(str(tmp_path / "ck"))
    for step in range(1, 11):
        (tmp_path / "ck" / f"step-{step:08d}").mkdir(parents=True)
        if step != 7:  # step 7 is torn
            (tmp_path / "ck" / f"step-{step:08d}" / "stalwart.json").write_text(json.dumps({"step": step}))
    storage.set_latest(9)  # step 10 has a manifest but was never pointed to
    removed = retention(storage, keep_last=2, keep_every=4)
    assert sorted(removed) == [1, 2, 3, 5, 6, 7]
    assert storage.steps() == [4, 8, 9, 10] and storage.committed() == [9, 8, 4]


def test_keeper_coalesces_when_persist_is_slow(env, monkeypatch):
    """Persisting every step while each persist takes 0.4 s: training never waits, the keeper says
    which steps it coalesced, and the final wait makes the last step durable."""
    monkeypatch.setenv("STALWART_CHAOS", "delay:seconds=0.4:at=persist")
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": opt}
    log = env["out"] / "keeper.log"
    ck = Checkpointer(str(env["ck"]), persist_every_steps=1, shm_root=str(env["shm"]), keeper_log=log, keeper_idle_s=10)
    assert ck.restore(state) == 0
    for step in range(1, 31):
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ck.save(step, state)
        time.sleep(0.05)
    ck.wait(persist=True)
    ck.close()
    assert Storage(str(env["ck"])).latest() == 30
    text = log.read_text()
    assert "coalesced" in text and "committed step 30" in text
    assert ck.writer.stats["skipped"] == 0  # the pinned slot never blocked a snapshot

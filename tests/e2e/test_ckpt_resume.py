"""Flash checkpoints with the real trainer: separate processes, gloo, SIGKILLed workers and keepers.

Proves bitwise resume (DDP and FSDP2, 2 ranks) after a worker is killed mid-snapshot or after a
snapshot, the keeper's replacement after it is killed mid-persist, and FSDP2 checkpoints restored on
1 and 3 ranks and by plain ``torch.distributed.checkpoint.load``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .hung import kill_tree

pytestmark = pytest.mark.e2e
STEPS = 8
COMMON = (
    "--data.seq_len=32",
    f"--train.steps={STEPS}",
    "--train.warmup_steps=2",
    "--train.global_batch=12",
    "--train.micro_batch=2",
    "--checkpoint.enabled=true",
    "--checkpoint.persist_every_steps=4",
    # The keeper outlives a killed launch this long: the next launch (seconds, minutes on a loaded box)
    # must find its snapshots; 30 s let it clean up before a slow relaunch attached (seen at load 30).
    "--checkpoint.keeper_idle_s=180",
)


def train(
    out: Path, data: Path, shm: Path, *extra: str, chaos: str = "", expect_ok: bool = True, nproc: int = 2
) -> dict | subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "stalwart",
        "train",
        f"--nproc={nproc}",
        "--config",
        "configs/debug.toml",
        f"--data.dir={data}",
        *COMMON,
        f"--train.out_dir={out}",
        f"--checkpoint.shm_dir={shm}",
        "--json",
        *extra,
    ]
    env = dict(os.environ, STALWART_CHAOS=chaos, STALWART_CHAOS_DIR=str(out / "chaos"))
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"training timed out:\n{stderr[-4000:]}") from None
    with open(out / "train.log", "a") as log:  # kept for post-mortems
        log.write(stderr)
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    if not expect_ok:
        return result
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "summary.json").read_text())


def wait_for_text(path: Path, text: str, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} did not appear in {path} within {timeout} s:\n{content[-3000:]}")


@pytest.fixture(scope="module")
def ddp_ref(stdlib_data, shm_root, tmp_path_factory):
    """Uninterrupted DDP run. Its keeper is SIGKILLed during its first persist: training must not
    notice (the hash is the reference for the resume test) and a new keeper must take over."""
    out = tmp_path_factory.mktemp("ddp-ref")
    return out, train(out, stdlib_data, shm_root, "--checkpoint.persist_every_steps=2", chaos="kill:at=persist")


@pytest.fixture(scope="module")
def fsdp_ref(stdlib_data, shm_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-ref")
    return out, train(out, stdlib_data, shm_root, "--parallel.dp_mode=fsdp")


def test_ddp_kill_during_snapshot_copy_resumes_bitwise(stdlib_data, shm_root, tmp_path, ddp_ref):
    _, ref = ddp_ref
    killed = train(tmp_path, stdlib_data, shm_root, chaos="kill:rank=1:step=5:at=copy", expect_ok=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    # The keeper (which outlives the workers) saves on failure the newest step both ranks hold.
    log = wait_for_text(tmp_path / "keeper.log", "save-on-failure step 4")
    assert "worker-died" in log
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000004"

    resumed = train(tmp_path, stdlib_data, shm_root)
    ck = resumed["checkpoint"]
    assert (ck["restored_from"], ck["restore_step"]) == ("memory", 4), ck
    assert resumed["final_hash"] == ref["final_hash"] and resumed["optim_hash"] == ref["optim_hash"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == f"step-{STEPS:08d}"


def test_a_step_killed_before_its_metrics_record_is_logged_from_its_snapshot(stdlib_data, shm_root, tmp_path, ddp_ref):
    ref_out, ref = ddp_ref
    # Rank 0 (which writes metrics.jsonl) dies right after step 5's checkpoint call, before the record.
    killed = train(tmp_path, stdlib_data, shm_root, chaos="kill:rank=0:step=5:at=saved", expect_ok=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4]  # the window: step 5 unlogged
    resumed = train(tmp_path, stdlib_data, shm_root)
    ck = resumed["checkpoint"]
    assert (ck["restored_from"], ck["restore_step"]) == ("memory", 5), ck
    assert resumed["final_hash"] == ref["final_hash"]
    got, want = records(tmp_path), {r["step"]: r for r in records(ref_out)}
    assert [(r["step"], r.get("restored", False)) for r in got] == [(s, s == 5) for s in range(1, STEPS + 1)]
    for r in got:  # the restart wrote step 5's from the values its snapshot carried: the fault-free run's
        keys = ("loss", "grad_norm", "lr", "samples_consumed")
        assert {k: r[k] for k in keys} == {k: want[r["step"]][k] for k in keys}, (r, want[r["step"]])


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_keeper_killed_mid_persist_is_replaced_and_latest_never_moves_to_a_torn_step(ddp_ref):
    out, ref = ddp_ref
    log = (out / "keeper.log").read_text()
    assert "stalwart chaos: firing 'kill:at=persist'" in log
    before, after = log.split("stalwart chaos: firing", 1)
    committed_before = re.findall(r"committed step (\d+)", before)
    latest_seen = re.search(r"latest committed: (\w+)", after).group(1)  # the next keeper's view
    assert latest_seen == (committed_before[-1] if committed_before else "none")
    assert re.search(r"removed-torn step \d+", after)
    assert f"committed step {STEPS}" in after
    assert (out / "checkpoints" / "latest").read_text() == f"step-{STEPS:08d}"
    assert ref["checkpoint"]["snapshots"] == STEPS and ref["checkpoint"]["snapshots_skipped"] == 0


def test_fsdp_kill_after_snapshot_restores_from_memory_bitwise(stdlib_data, shm_root, tmp_path, fsdp_ref):
    # Two launches rather than torchrun --max-restarts: restarted gloo workers sometimes hang in
    # connectFullMesh on this stack (see DESIGN.md pitfalls); the restore path is the same.
    _, ref = fsdp_ref
    # Rank 0's step-5 copy is slowed (as under load): "kill after step 5" still leaves step 5 on both ranks.
    chaos = "kill:rank=1:step=5;delay:at=copy:rank=0:step=5:seconds=1"
    killed = train(tmp_path, stdlib_data, shm_root, "--parallel.dp_mode=fsdp", chaos=chaos, expect_ok=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr
    wait_for_text(tmp_path / "keeper.log", "save-on-failure step 5")
    summary = train(tmp_path, stdlib_data, shm_root, "--parallel.dp_mode=fsdp")
    ck = summary["checkpoint"]
    assert (ck["restored_from"], ck["restore_step"]) == ("memory", 5), ck
    assert summary["final_hash"] == ref["final_hash"] and summary["optim_hash"] == ref["optim_hash"]


@pytest.mark.parametrize("nproc", [1, 3])
def test_fsdp_checkpoint_restores_on_other_world_sizes(stdlib_data, shm_root, tmp_path, fsdp_ref, nproc):
    src, ref = fsdp_ref
    shutil.copytree(src / "checkpoints", tmp_path / "checkpoints")
    summary = train(tmp_path, stdlib_data, shm_root, "--parallel.dp_mode=fsdp", nproc=nproc)
    ck = summary["checkpoint"]
    assert (ck["restored_from"], ck["restore_step"], summary["world_size"]) == ("storage", STEPS, nproc), ck
    assert summary["final_hash"] == ref["final_hash"] and summary["optim_hash"] == ref["optim_hash"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_load_reads_an_fsdp_checkpoint(fsdp_ref):
    import torch.distributed.checkpoint as dcp

    from stalwart.models import Transformer, model_args
    from stalwart.utils import state_dict_hash

    src, ref = fsdp_ref
    model = Transformer(model_args("debug", vocab_size=257, max_seq_len=32))  # the byte corpus: 257 ids
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(src / "checkpoints" / f"step-{STEPS:08d}"))
    model.load_state_dict(state["model"])
    assert state_dict_hash(model.state_dict()) == ref["final_hash"]

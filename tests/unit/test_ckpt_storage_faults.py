"""Storage faults on real filesystems: a full tmpfs, a read-only mount, an unreachable endpoint.

Each test runs a real keeper process (or the Checkpointer's own) against a small filesystem mounted
here, and checks the outcome: the incident journaled with its cause, no torn step directory, the first
commit after recovery verified, or the error that names the shared-memory copy.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

from stalwart.checkpoint import Checkpointer, NodeJob, Storage
from stalwart.checkpoint.keeper_link import spawn_keeper
from stalwart.checkpoint.storage_health import INCIDENTS_FILE, AtRiskPolicy, StorageUnavailableError, classify
from stalwart.health.log_rules import diagnose
from stalwart.launch.decide import decide
from stalwart.launch.detect import Incident
from tests.unit.test_ckpt_keeper import _snapshot, _until

POLICY = {"persist_every_steps": 2, "persist_every_s": 0, "keep_last": 3, "keep_every": 0, "idle_s": 120}


def _mount(path: Path, *opts: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(path)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'not permitted'})")


@pytest.fixture
def root():
    path = Path("/dev/shm") / f"stalwart-faults-{uuid.uuid4().hex[:8]}" / "job"
    yield path
    subprocess.run(["rm", "-rf", str(path.parent)], check=False)


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs (unmounted afterwards); skipped where mounting is not permitted."""
    path = tmp_path / "fs"
    _mount(path, "size=64k")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path: Path) -> Path:
    """Fill the filesystem at ``path`` to the last byte (a real ENOSPC for the next write)."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return filler


def _incidents(job: NodeJob) -> list[dict]:
    path = job.root / INCIDENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _start(job: NodeJob, storage: Storage, log: Path) -> subprocess.Popen:
    job.paths.owner(0).write_text(f'{{"pid": {os.getpid()}, "rank": 0, "world_size": 1}}')  # a live worker
    job.write_job(storage, 1, [0], POLICY, keeper=True, keeper_log=None)
    return spawn_keeper(job, log, parent=os.getpid(), grace_s=20)


def test_full_disk_is_an_incident_leaves_no_torn_step_and_commits_once_space_is_freed(root, small_fs, tmp_path):
    job, storage = NodeJob(root), Storage(str(small_fs / "ckpt"))
    _snapshot(job, [1, 2], persist={2})
    filler = _fill(small_fs)
    keeper = _start(job, storage, tmp_path / "keeper.log")
    try:
        assert _until(lambda: len(_incidents(job)) >= 1), (tmp_path / "keeper.log").read_text()
        first = _incidents(job)[0]
        assert (first["kind"], first["detail"]["cause"], first["step"]) == ("storage", "full", 2)
        assert _until(
            lambda: job.job() and (json.loads(job.paths.keeper_status.read_text())["storage"]["failures"] >= 2)
        )
        assert storage.steps() == [], "each failed attempt was removed"
        filler.unlink()  # space freed mid-run: a retry (with backoff) commits
        assert _until(lambda: storage.latest() == 2), (tmp_path / "keeper.log").read_text()
        assert storage.verify(2) == []
        # ``latest`` moves inside the commit; the keeper journals the recovery after it returns.
        assert _until(lambda: "recovered" in _incidents(job)[-1]["detail"]), _incidents(job)
        recovered = _incidents(job)[-1]["detail"]
        assert recovered["recovered"] and recovered["cause"] == "full" and recovered["failed_attempts"] >= 2
        assert "storage full" in (tmp_path / "keeper.log").read_text()
    finally:
        keeper.send_signal(signal.SIGTERM)
        keeper.wait(30)


def test_read_only_store_stops_the_final_wait_naming_the_shared_memory_copy(tmp_path, monkeypatch):
    """The Checkpointer's own keeper cannot write (a read-only mount): ``ensure_durable`` gives up after
    its attempts with an error naming the shm directory; `ckpt persist-from-memory` commits it later."""
    store = tmp_path / "ro"
    _mount(store, "size=1m")
    shm = Path("/dev/shm") / f"stalwart-ro-{uuid.uuid4().hex[:8]}"
    shm.mkdir()
    monkeypatch.chdir(tmp_path)
    try:
        subprocess.run(["mount", "-o", "remount,ro", str(store)], check=True)
        torch.manual_seed(0)
        model = nn.Linear(8, 8)
        state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}
        ckpt = Checkpointer(
            str(store / "ckpt"),
            persist_every_steps=2,
            shm_root=str(shm),
            keeper_log=tmp_path / "k.log",
            keeper_idle_s=1,
        )
        assert ckpt.restore(state) == 0
        for step in (1, 2):
            model(torch.randn(2, 8)).sum().backward()
            state["optim"].step()
            ckpt.save(step, state)
        with pytest.raises(StorageUnavailableError) as err:
            ckpt.ensure_durable(2)
        assert str(ckpt.paths.root) in str(err.value) and "persist-from-memory" in str(err.value)
        assert "storage permission" in str(err.value)
        assert [r["detail"]["cause"] for r in _incidents(ckpt.job)][:1] == ["permission"]
        ckpt.close(success=False)
        subprocess.run(["mount", "-o", "remount,rw", str(store)], check=True)
        from stalwart.cli import main

        assert main(["ckpt", "persist-from-memory", str(ckpt.paths.root), "--json"]) == 0
        assert Storage(str(store / "ckpt")).latest() == 2 and Storage(str(store / "ckpt")).verify(2) == []
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)
        subprocess.run(["rm", "-rf", str(shm)], check=False)


def test_causes_of_real_errors(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError) as refused:
        socket.create_connection(("127.0.0.1", port), timeout=5)
    assert classify(refused.value) == "unreachable"
    assert classify(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")) == "torn"
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as inner:
        try:
            raise RuntimeError("unexpected pos 704 vs 598") from inner
        except RuntimeError as outer:
            assert classify(outer) == "full", "the errno under a torn write names the cause"
    assert classify(TimeoutError("read timed out")) == "timeout"
    assert classify(OSError(errno.EROFS, "Read-only file system")) == "permission"


def test_at_risk_policy_applies_only_while_storage_fails():
    policy = AtRiskPolicy(max_steps=10, max_s=60)
    ok = {"ok": True, "last_committed": 0}
    failing = {"ok": False, "last_committed": 20, "last_commit_time": 1000.0}
    assert policy.violation(ok, 500, 5000.0, 0.0) is None, "healthy storage with a long interval is fine"
    assert policy.violation(failing, 30, 1010.0, 0.0) is None
    assert "max_unpersisted_steps=10" in policy.violation(failing, 31, 1010.0, 0.0)
    assert "max_unpersisted_s=60" in policy.violation(failing, 25, 1061.0, 0.0)
    assert AtRiskPolicy(0, 0).violation(failing, 10**6, 10**9, 0.0) is None


def test_a_storage_failure_is_not_retried_by_a_restart():
    text = "Traceback ...\nstalwart.checkpoint.storage_health.StorageUnavailableError: step 120 ... Connection refused"
    diagnosis = diagnose(text)
    assert (diagnosis.kind, diagnosis.cls, diagnosis.retry(True)) == ("storage", "storage", False)
    incident = Incident(diagnosis.kind, diagnosis.cls, diagnosis.retry(True), 0.0, ranks=[0])
    decision = decide(incident, lambda: pytest.fail("no restart is asked for"), 3)
    assert not decision.restart and "cannot fix" in decision.reason


def test_the_agents_keeper_journals_beside_its_status_copy_so_the_final_pass_reaches_the_agent(root, tmp_path):
    """The keeper removes the job's shm directory when it finishes; its last storage records (a
    recovery at the final commit) must outlive it, where the agent's StorageWatch reads them."""
    import shutil

    from stalwart.checkpoint.keeper import Keeper
    from stalwart.launch.storage_watch import StorageWatch

    job, storage = NodeJob(root), Storage(str(tmp_path / "ckpt"))
    job.root.mkdir(parents=True, mode=0o700)
    job.write_job(storage, 1, [0], POLICY, keeper=True, keeper_log=None)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    keeper = Keeper(job, status_copy=run_dir / "keeper-status.json")
    keeper.health.failed("persist", 2, OSError(errno.ENOSPC, "No space left on device"))
    keeper.health.committed(4)  # the final pass's commit
    shutil.rmtree(job.root)  # as Keeper._finish does
    records = StorageWatch(run_dir / "keeper-status.json")()[0]
    assert [(r["step"], r["detail"]["cause"], r["detail"].get("recovered", False)) for r in records] == [
        (2, "full", False),
        (4, "full", True),
    ]

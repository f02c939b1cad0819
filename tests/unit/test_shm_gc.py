"""Snapshots an ended job left in shared memory expire (``kept.json``, ``checkpoint.keep_shm_s``), and
``stalwart ckpt gc`` removes the stale ones — never a directory a live worker or keeper owns. Times are
passed in (``now``), never slept."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from stalwart.checkpoint.shm import JobPaths, atomic_write, secure_job_dir, user_dir
from stalwart.checkpoint.shm_gc import DEFAULT_KEEP_S, collect, kept_line, mark_kept, scan, sweep
from stalwart.cli import main as cli
from stalwart.config import CheckpointConfig


@pytest.fixture
def shm():
    root = Path("/dev/shm") / f"stalwart-gc-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def ended_job(shm: Path, name: str, mib: int = 1, policy: dict | None = None, mtime: float | None = None) -> JobPaths:
    """A job directory as an ended job leaves it: job.json, a rank's slot, nobody attached."""
    paths = JobPaths(secure_job_dir(user_dir(shm) / name))  # as a worker's attach creates it
    paths.job_lock.touch()
    paths.rank_dir(0).mkdir()
    atomic_write(paths.job, json.dumps({"storage": "/nowhere", "policy": policy or {}}).encode())
    atomic_write(paths.slot(0, 0, "bin"), b"\1" * (mib << 20))
    atomic_write(paths.owner(0), json.dumps({"pid": 999_999_999, "time": 0}).encode())  # dead
    if mtime is not None:
        for p in paths.root.rglob("*"):
            os.utime(p, (mtime, mtime))
    return paths


def by_name(entries):
    return {Path(d.path).name: d for d in entries}


def test_a_kept_directory_expires_after_its_keep_time(shm):
    t0 = 1_800_000_000.0
    paths = ended_job(shm, "kept")
    line = mark_kept(paths, 600.0, "preempted", step=8, now=t0)
    assert line == kept_line(paths.root)
    assert (
        f"snapshots kept in {paths.root} for the requeue until " in line and "`stalwart ckpt gc` removes them" in line
    )
    [d] = scan(shm, now=t0 + 599)
    assert (d.until, d.live, d.expired, d.why) == (t0 + 600, None, False, "preempted")
    assert d.bytes >= 1 << 20
    assert sweep(scan(shm, now=t0 + 599)) == [] and paths.root.is_dir()
    [d] = scan(shm, now=t0 + 600)
    assert d.expired
    assert [x.path for x in sweep([d])] == [str(paths.root)] and not paths.root.exists()


def test_an_unmarked_directory_expires_its_jobs_keep_time_after_its_last_change(shm):
    """Left by an older stalwart or a SIGKILLed agent: no kept.json, so its newest file's time counts, and
    the longer of the job's own keep_shm_s and gc's keep_s (an unmarked directory may be a job between
    restarts that nobody holds: a short keep_shm_s, meant for kept snapshots, must not remove it)."""
    t0 = 1_800_000_000.0
    ended_job(shm, "own", policy={"keep_shm_s": 50.0}, mtime=t0)
    ended_job(shm, "long", policy={"keep_shm_s": 2 * DEFAULT_KEEP_S}, mtime=t0)
    ended_job(shm, "default", mtime=t0)
    entries = by_name(scan(shm, now=t0 + 60))
    assert not entries["own"].expired and not entries["default"].expired, "gc's keep_s is the floor"
    assert entries["own"].age_s == pytest.approx(60) and entries["own"].until is None
    short = by_name(scan(shm, keep_s=30.0, now=t0 + 60))
    assert short["own"].expired and short["default"].expired and not short["long"].expired
    assert not by_name(scan(shm, keep_s=30.0, now=t0 + 40))["own"].expired, "the job's own 50 s is longer"
    at_default = by_name(scan(shm, now=t0 + DEFAULT_KEEP_S))
    assert at_default["default"].expired and at_default["own"].expired and not at_default["long"].expired


def _holder(lock: Path, how: str) -> subprocess.Popen:
    """A real process that holds ``lock`` (fcntl.LOCK_SH: workers attached, LOCK_EX: a keeper) until killed."""
    code = (
        f"import fcntl, os, time; fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT); "
        f"fcntl.flock(fd, fcntl.{how}); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-S", "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_gc_never_removes_a_live_jobs_directory(shm):
    t0 = time.time()
    attached = ended_job(shm, "attached", mtime=t0 - 10 * DEFAULT_KEEP_S)
    keeper = ended_job(shm, "keeper", mtime=t0 - 10 * DEFAULT_KEEP_S)
    running = ended_job(shm, "running")
    reused = ended_job(shm, "reused")
    dead = ended_job(shm, "dead")
    for paths in (attached, keeper, running, reused, dead):
        mark_kept(paths, 0.0, "test", now=t0 - 1)  # all expired
    workers = _holder(attached.job_lock, "LOCK_SH")  # as NodeJob.attach holds it
    serving = _holder(keeper.keeper_lock, "LOCK_EX")  # as a keeper holds it
    # a rank that runs but holds no lock (between its start and attach): its owner record names it
    atomic_write(running.owner(0), json.dumps({"pid": serving.pid, "time": time.time()}).encode())
    # a record naming a pid that now belongs to a process started after it: a reused pid, not the rank
    atomic_write(reused.owner(0), json.dumps({"pid": serving.pid, "time": t0 - 3600}).encode())
    try:
        entries = by_name(scan(shm))
        assert entries["attached"].live == "workers attached"
        assert entries["keeper"].live == "a keeper serves it"
        assert entries["running"].live == f"rank 0 (pid {serving.pid}) runs"
        assert entries["reused"].live is None and entries["dead"].live is None
        removed = sweep(list(entries.values()), everything=True)
        assert sorted(Path(d.path).name for d in removed) == ["dead", "reused"]
        assert attached.root.is_dir() and keeper.root.is_dir() and running.root.is_dir()
        assert (attached.slot(0, 0, "bin")).stat().st_size == 1 << 20  # not a file of it touched
    finally:
        for proc in (workers, serving):
            proc.kill()
            proc.wait()
    assert sorted(Path(d.path).name for d in sweep(scan(shm), everything=True)) == ["attached", "keeper", "running"]


def test_gc_cli_dry_run_removes_nothing_and_lists_what_it_would(shm, capsys):
    t0 = time.time()
    old = ended_job(shm, "old", mib=2)
    mark_kept(old, 10.0, "preempted", now=t0 - 60)
    young = ended_job(shm, "young")
    mark_kept(young, 3600.0, "preempted", now=t0)

    assert cli(["ckpt", "gc", "--shm-dir", str(shm), "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {Path(r["path"]).name: r for r in out["dirs"]}
    assert out["dry_run"] and rows["old"]["removed"] and rows["old"]["expired"] and not rows["young"]["removed"]
    assert old.root.is_dir() and young.root.is_dir()

    assert cli(["ckpt", "gc", "--shm-dir", str(shm), "--all", "--dry-run"]) == 0
    assert "would remove 2" in capsys.readouterr().out and old.root.is_dir() and young.root.is_dir()

    assert cli(["ckpt", "gc", "--shm-dir", str(shm)]) == 0  # only the expired
    text = capsys.readouterr().out
    assert "removed 1 (2.0 MiB)" in text and "kept until" in text
    assert not old.root.exists() and young.root.is_dir()
    assert cli(["ckpt", "gc", "--shm-dir", str(shm), "--all"]) == 0 and not young.root.exists()


def test_a_runs_start_message_counts_and_removes_the_expired(shm):
    t0 = time.time()
    mark_kept(ended_job(shm, "expired", mib=3), 1.0, "preempted", now=t0 - 10)
    mark_kept(ended_job(shm, "kept", mib=2), 3600.0, "preempted", now=t0)
    secure_job_dir(user_dir(shm) / "starting")  # another agent's, its keeper not started yet: not counted
    line = collect(shm, now=t0)
    assert line == (
        f"stale snapshots in {user_dir(shm)}: removed 1 expired (3.0 MiB); 1 kept from ended jobs hold "
        "2.0 MiB (`stalwart ckpt gc --all` removes them)"
    ), line
    assert sorted(os.listdir(user_dir(shm))) == ["kept", "starting"]
    assert collect(Path("/dev/shm") / f"stalwart-none-{uuid.uuid4().hex[:6]}") is None  # nothing there: silent


def test_keep_shm_s_is_checked_and_matches_the_default():
    assert CheckpointConfig().keep_shm_s == DEFAULT_KEEP_S
    with pytest.raises(ValueError, match="keep_shm_s"):
        CheckpointConfig(keep_shm_s=-1).validate()


def test_a_keeper_stopped_while_it_starts_still_tidies_the_job(shm, tmp_path):
    """A short job can end while the agent's keeper still imports: SIGTERM then killed it before its final
    pass, and the job's directory stayed in shm (test_run_ends left one per run). The stop now waits until
    the keeper catches the signal, so the final pass finds every rank closed and removes the directory."""
    from stalwart.checkpoint.keeper_process import KeeperProcess
    from stalwart.checkpoint.node_job import NodeJob

    job = NodeJob(secure_job_dir(user_dir(shm) / "short"))
    job.paths.rank_dir(0).mkdir()
    atomic_write(job.paths.job, json.dumps({"storage": str(tmp_path / "ckpt"), "world_size": 1}).encode())
    atomic_write(job.paths.owner(0), json.dumps({"pid": 999_999_999, "world_size": 1, "time": 0}).encode())
    atomic_write(job.paths.closed(0), json.dumps({"pid": 999_999_999}).encode())
    keeper = KeeperProcess(job, tmp_path / "keeper.log", grace_s=60).start()
    keeper.stop()  # at once: the keeper is still importing torch
    assert keeper.proc.returncode is not None
    assert "stopping: the agent stops the keeper" in (tmp_path / "keeper.log").read_text()
    assert not job.root.exists() and keeper.kept() is None


@pytest.mark.parametrize("snapshots", [False, True])
def test_the_agent_removes_what_a_killed_keeper_left_only_if_it_holds_no_job(shm, tmp_path, snapshots):
    """A keeper killed before its final pass cannot remove the directory the agent made for it (CI16,
    CI23: an evicted node's empty directory outlived the test session): the agent removes it once the
    keeper has exited, unless it holds a job's snapshots (those are for `stalwart ckpt gc` to expire)."""
    from stalwart.checkpoint.keeper_process import KeeperProcess
    from stalwart.checkpoint.node_job import NodeJob

    job = NodeJob(user_dir(shm) / "evicted")
    keeper = KeeperProcess(job, tmp_path / "keeper.log", grace_s=60).start()
    assert job.root.is_dir()  # made for the keeper before it runs
    if snapshots:
        job.paths.rank_dir(0).mkdir()
    keeper.proc.kill()
    keeper.proc.wait()
    keeper.stop()
    assert job.root.exists() == snapshots


def test_a_keeper_that_exits_on_its_own_is_replaced_until_the_agent_stops_it(shm, tmp_path):
    """Killed while the job runs (the OOM killer), the agent's keeper is replaced at the agent's next
    monitor tick (``ensure``), at most every ``REPLACE_EVERY_S``; once the agent stops it, never."""
    from stalwart.checkpoint.keeper_process import KeeperProcess
    from stalwart.checkpoint.node_job import NodeJob

    keeper = KeeperProcess(NodeJob(user_dir(shm) / "oom"), tmp_path / "keeper.log", grace_s=60).start()
    first = keeper.proc
    assert keeper.ensure() is None, "a running keeper is left alone"
    first.kill()
    first.wait()
    assert keeper.ensure() is None, "not again within REPLACE_EVERY_S of the last start"
    keeper.REPLACE_EVERY_S = 0.0
    said = keeper.ensure()
    assert said is not None and f"keeper (pid {first.pid}) exited with -9" in said, said
    assert keeper.proc is not first and keeper.proc.poll() is None and keeper.replaced == 1
    assert f"started keeper pid {keeper.proc.pid}" in said
    keeper.stop()
    assert keeper.proc.returncode is not None and keeper.ensure() is None, "a stopped keeper stays stopped"


def test_a_keeper_that_keeps_dying_is_replaced_with_backoff_then_no_more_and_a_failed_start_is_said(shm, tmp_path):
    """Each quick death doubles the wait before the next replacement; after REPLACE_AT_MOST in a row the
    agent stops trying (a keeper that crashes the same way would cost a core's imports every 5 s). A
    replacement that cannot start (a full disk, no memory) is said on the console, not raised: the
    workers train on."""
    from stalwart.checkpoint.keeper_process import KeeperProcess
    from stalwart.checkpoint.node_job import NodeJob

    keeper = KeeperProcess(NodeJob(user_dir(shm) / "crashy"), tmp_path / "keeper.log", grace_s=60).start()
    keeper.REPLACE_EVERY_S, keeper.REPLACE_AT_MOST = 0.05, 3
    said = []
    try:
        for _ in range(40):  # 0.05 · (1 + 2 + 4 + 8) s of backoff in all, well within
            if keeper.proc.poll() is None:
                keeper.proc.kill()
                keeper.proc.wait()
            if (line := keeper.ensure()) is not None:
                said.append(line)
            time.sleep(0.05)
        assert keeper.replaced == 4 and len(said) == 4, said  # the first death is not a quick one in a row
        assert "if this one dies too, no other is started" in said[-1]
        assert keeper.proc.poll() is not None and keeper.ensure() is None, "given up"

        other = KeeperProcess(NodeJob(user_dir(shm) / "nolog"), tmp_path / "keeper2.log", grace_s=60).start()
        other.REPLACE_EVERY_S = 0.0
        other.proc.kill()
        other.proc.wait()
        other.log_path = tmp_path / "no-such-dir" / "keeper.log"  # the log cannot be opened: OSError
        line = other.ensure()
        assert line is not None and "could not start another (FileNotFoundError" in line, line
        assert other.replaced == 0
    finally:
        keeper.stop()


class _Stopped:
    """The agent's stop request, already made (``keeper_process.StopRequest`` without its signals)."""

    parent, grace_s, why = os.getppid(), 5.0, "the agent stops the keeper"

    def __call__(self) -> bool:
        return True


def test_a_memory_only_job_ended_by_the_agent_is_kept_with_an_expiry(shm, tmp_path, caplog):
    """The agent's keeper has nothing to persist for a memory-only job (workers SIGTERMed): the snapshots
    stay for a requeue, marked with the job's keep_shm_s and said in the log the agent prints from."""
    from stalwart.checkpoint.keeper_serve import serve
    from stalwart.checkpoint.node_job import NodeJob

    job = NodeJob(secure_job_dir(user_dir(shm) / "memonly"))
    job.paths.rank_dir(0).mkdir()
    policy = {"persist_every_steps": 0, "keep_shm_s": 120.0}
    spec = {"storage": str(tmp_path / "ck"), "policy": policy, "keeper": False}
    atomic_write(job.paths.job, json.dumps(spec).encode())
    atomic_write(job.paths.owner(0), json.dumps({"pid": 999_999_999, "world_size": 1, "time": 0}).encode())
    t0 = time.time()
    assert serve(job, _Stopped()) == 0
    kept = json.loads(job.paths.kept.read_text())
    assert kept["why"] == "the agent stops the keeper" and t0 + 120 <= kept["until"] <= time.time() + 120
    assert f"snapshots kept in {job.root} for the requeue until" in caplog.text
    [entry] = scan(shm, now=kept["until"] + 1)
    assert entry.until == kept["until"]
    assert entry.live == f"keeper pid {os.getpid()} runs" and not entry.expired  # the keeper ran in this process

"""A script's end under `stalwart run`: what plain `python` ends ends here too, and a finished job is never
redone (issue 27: a NCCL script with an open executor never exited, the hang detector restarted it)."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import pytest

from stalwart import runtime
from stalwart.checkpoint.node_job import NodeJob, job_dir_for
from stalwart.checkpoint.shm import JobPaths, atomic_write, secure_job_dir
from stalwart.checkpoint.shm_gc import mark_kept
from tests.e2e.test_run import launch

pytestmark = pytest.mark.e2e
SCRIPT = "open_ends.py"


def _run(tmp_path, *script_args: str, run_args: tuple[str, ...] = ()):
    t0 = time.monotonic()
    proc, summary, out = launch(
        tmp_path, *script_args, run_args=("--max-restarts", "1", *run_args), script=SCRIPT, timeout=180
    )
    return proc, summary, out, time.monotonic() - t0


def _finished_once(proc, summary, out) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((out / "result.json").read_text())["step"] == 20
    assert summary["incidents"] == [] and summary["restarts_used"] == 0, summary
    attempts = sorted(p.name for p in out.glob("attempt-*"))
    assert attempts == ["attempt-rank0-0", "attempt-rank1-0"], "the script ran once"


@pytest.mark.parametrize("warm", ["on", "off"])
def test_a_script_leaving_an_executor_and_a_checkpointer_open_ends_once(tmp_path, warm, shm_root, monkeypatch):
    # A private root: another `stalwart run` on the host (a parallel test) would collect /dev/shm's first.
    monkeypatch.setenv(runtime.ENV_SHM_DIR, str(shm_root))
    expired = plant_expired_snapshots(shm_root)
    proc, summary, out, _ = _run(tmp_path, run_args=("--warm-start", warm))
    _finished_once(proc, summary, out)
    # it ended by itself: no hang declared, no watchdog (which names what it waited for)
    assert "silent for" not in proc.stderr and "the script ended (exit code" not in proc.stderr, proc.stderr[-3000:]
    # at its start the agent removed an ended job's expired snapshots, and said so
    assert re.search(rf"stalwart run: stale snapshots in {expired.parent}: removed \d+ expired", proc.stderr)
    assert not expired.exists()
    # the job was short: its keeper may still have been starting when it ended, yet it tidied (issue 30)
    run = json.loads((tmp_path / "run" / "master.json").read_text())
    assert not NodeJob.of_agent(run["job_id"], run["node_id"]).root.exists()


def plant_expired_snapshots(shm_root: Path) -> Path:
    """An ended job's directory whose keep time has passed, as a preempted job's keeper leaves it."""
    paths = JobPaths(secure_job_dir(job_dir_for("", shm_root, f"ended-{uuid.uuid4().hex[:8]}")))
    paths.rank_dir(0).mkdir()
    atomic_write(paths.slot(0, 0, "bin"), b"\0" * 4096)
    mark_kept(paths, 1.0, "test", now=time.time() - 60)
    return paths.root


def test_a_thread_that_never_ends_is_named_and_the_job_still_finishes(tmp_path):
    proc, summary, out, _ = _run(tmp_path, "--stuck-thread", run_args=("--exit-grace", "2"))
    _finished_once(proc, summary, out)
    assert "rank 1: the script ended (exit code 0) 2 s ago" in proc.stderr, proc.stderr[-3000:]
    assert "still running: 'user-never-ends'" in proc.stderr


def test_a_rank_stuck_in_c_after_its_script_returned_is_ended_by_the_agent(tmp_path):
    """The thread holds the GIL, so the worker's own watchdog cannot run: the agent dumps its stacks and
    ends it, and the job counts as finished."""
    proc, summary, out, _ = _run(tmp_path, "--gil-stuck", run_args=("--exit-grace", "2"))
    _finished_once(proc, summary, out)
    assert "rank 1 returned from its script" in proc.stderr, proc.stderr[-3000:]
    assert "thread(s) 'user-never-ends'" in proc.stderr, proc.stderr[-6000:]

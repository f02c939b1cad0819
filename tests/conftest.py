"""Shared fixtures: one prepared copy of the built-in corpus per test session; private /dev/shm roots; the
suite-level check that no job the tests ran left its snapshots in /dev/shm."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stalwart.data import ensure_default_corpus

    return ensure_default_corpus(tmp_path_factory.mktemp("data") / "stdlib-byte")


@pytest.fixture(autouse=True)
def sigterm_left_as_found():
    """A test that leaves SIGTERM ignored (or handled) in the test process makes every process started
    after it in that process inherit an ignored SIGTERM (CI: a child that `terminate()` did not end):
    such a test fails here, and the disposition is put back."""
    from stalwart.runtime import sigterm

    before = signal.getsignal(signal.SIGTERM)
    yield
    after = signal.getsignal(signal.SIGTERM)
    if after is sigterm._on_signal and before is signal.SIG_DFL and not sigterm.installed():
        # A Checkpointer's handler, closed but put back by a framework that wrapped it (Lightning): it
        # acts as the default does (test_sigterm), and is put back to the default here.
        signal.signal(signal.SIGTERM, before)
    elif after is not before:
        signal.signal(signal.SIGTERM, before)
        pytest.fail(f"the test left SIGTERM's handler changed ({before!r} → {after!r})")


@pytest.fixture(scope="module")
def shm_root() -> Path:
    """A private /dev/shm root for one test module's jobs; keepers started under it are killed after."""
    root = Path("/dev/shm") / f"stalwart-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    from stalwart.checkpoint.shm import user_dir

    for status in user_dir(root).glob("*/keeper.json"):
        try:
            os.kill(int(json.loads(status.read_text())["pid"]), signal.SIGKILL)
        except (ProcessLookupError, KeyError, TypeError, ValueError):
            pass
    shutil.rmtree(root, ignore_errors=True)


def _this_sessions(job_dir: Path, basetemp: str, agent_dirs: set[str]) -> bool:
    """A job directory belongs to this session when its job.json names storage or a log in our temporary
    directory, or a `stalwart run` agent of ours named it (run_dir/master.json: job and node id). Other
    sessions on the host (other checkouts' suites) create directories in /dev/shm meanwhile."""
    if job_dir.name in agent_dirs:
        return True
    try:
        job = json.loads((job_dir / "job.json").read_text())
    except (OSError, ValueError):
        return False
    return any(str(job.get(k) or "").startswith(basetemp) for k in ("storage", "keeper_log"))


@pytest.fixture(scope="session", autouse=True)
def no_job_left_in_shm(tmp_path_factory: pytest.TempPathFactory):
    """Fails the session if a job a test ran left its directory under /dev/shm/stalwart-<uid> (issue 30:
    109 MiB built up over a day's runs). A test that keeps snapshots by design (a preempted job's, for
    the requeue) removes them itself. What is found is removed, so it does not build up either."""
    from stalwart.checkpoint.shm import JobPaths, user_dir
    from stalwart.checkpoint.shm_gc import owner

    base = user_dir("/dev/shm")
    before = set(os.listdir(base)) if base.is_dir() else set()
    yield
    basetemp = str(tmp_path_factory.getbasetemp())
    agent_dirs = set()
    for record in Path(basetemp).rglob("master.json"):
        try:
            rec = json.loads(record.read_text())
            agent_dirs.add(f"{rec['job_id']}-{re.sub(r'[^A-Za-z0-9._-]', '_', rec['node_id'])}")
        except (OSError, ValueError, KeyError, TypeError):
            continue
    new = [base / n for n in (set(os.listdir(base)) if base.is_dir() else set()) - before]
    ours = [d for d in new if _this_sessions(d, basetemp, agent_dirs)]
    # A preempted agent's keeper may still be finishing on its own, and a keeper's final rmtree removes
    # the files before the directory (CI16: an empty spare's directory seen at the end of the session).
    # A directory still there after the deadline, empty or not, fails the session.
    deadline = time.monotonic() + 15

    def finishing(d: Path) -> bool:
        try:
            return d.is_dir() and bool(owner(JobPaths(d)) or not any(d.iterdir()))
        except FileNotFoundError:  # removed meanwhile
            return False

    while any(finishing(d) for d in ours) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {d.name: sorted(os.listdir(d)) for d in ours if d.is_dir()}
    for name in left:
        shutil.rmtree(base / name, ignore_errors=True)
    assert not left, f"jobs of this test session left their directories in {base}:\n" + "\n".join(
        f"  {name}: {' '.join(files)}" for name, files in left.items()
    )

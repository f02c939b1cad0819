"""The end-to-end tests' shared fixtures."""

from __future__ import annotations

import json
import subprocess

import pytest
from filelock import FileLock

from .test_preempt import command


@pytest.fixture(scope="session")
def preempt_reference(stdlib_data, tmp_path_factory, worker_id) -> dict:
    """test_preempt's training uninterrupted (2 ranks on one local agent), run once per test session:
    test_preempt and test_slurm compare with the same command's result (xdist workers share it through
    a lock in the session's base directory)."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent
    with FileLock(shared / "preempt-reference.lock"):
        summary = shared / "preempt-reference" / "out" / "summary.json"
        if not summary.exists():
            ref = subprocess.run(
                command(shared / "preempt-reference", stdlib_data, "run"), capture_output=True, text=True, timeout=300
            )
            assert ref.returncode == 0, ref.stderr[-4000:]
        return json.loads(summary.read_text())

"""`stalwart run` with real workers, real gloo groups and real faults."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).parent / "scripts" / "faulty.py"
EXPECTED_X = sum((0 + s) + (1 + s) for s in range(1, 13))  # the job's result for 12 steps, 2 ranks


def launch(
    tmp_path: Path, *script_args: str, run_args: tuple[str, ...] = (), timeout: float = 240, script: str = SCRIPT.name
):
    out = tmp_path / "job"
    out.mkdir(exist_ok=True)
    summary = tmp_path / "summary.json"
    cmd = [
        sys.executable,
        "-m",
        "stalwart",
        "run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--run-dir",
        str(tmp_path / "run"),
        "--summary-json",
        str(summary),
        *run_args,
        str(SCRIPT.parent / script),
        "--out",
        str(out),
        *script_args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return proc, json.loads(summary.read_text()) if summary.exists() else None, out


# Any script (not only `stalwart train`): a signal death and a stopped process. Every fault kind with the
# trainer and bitwise-compared weights: tests/e2e/test_run_train.py.
@pytest.mark.parametrize("fault, kind", [("kill", "sigkill"), ("stop", "hang")])
def test_job_survives_fault_with_exact_result(tmp_path, fault, kind):
    proc, summary, out = launch(tmp_path, "--fault", fault, run_args=("--max-restarts", "2", "--hang-timeout", "3"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((out / "result.json").read_text()) == {"step": 12, "x": EXPECTED_X}
    [incident] = summary["incidents"]
    assert incident["kind"] == kind and summary["restarts_used"] == 1
    assert incident["fault"] <= incident["detected"] <= incident["first_step"]
    if kind == "hang":
        assert "Python stacks of rank 1" in proc.stderr
        stacks = proc.stderr.split("Python stacks of rank 1")[1]
        # The worker's own frames (a warm-started worker is a fork, not the launcher's stand-in process).
        assert re.search(r"\(faulty\.py:\d+\)", stacks), "py-spy shows where it hangs"
    else:
        assert incident["ranks"] == [1], "the failed rank, not the peer the agent stopped"
    # The incident is journaled by the master with every timestamp of the recovery.
    from stalwart.launch.journal import Journal

    [row] = Journal(tmp_path / "run" / "journal.sqlite").incidents()
    assert row["kind"] == kind and all(row[k] for k in ("fault", "detected", "stopped", "restarted", "first_step"))
    assert row["fault"] <= row["detected"] <= row["stopped"] <= row["restarted"] <= row["first_step"]
    if kind == "hang":  # declared once the rank was silent for the timeout (counted from its last report,
        # a few ms before the fault's own time stamp), not before
        assert min(row["details"]["silent_s"].values()) >= 3.0, row["details"]


def test_syntax_error_fails_fast_with_traceback(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\ndef broken(:\n    pass\n")
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stalwart",
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "--run-dir",
            str(tmp_path / "run"),
            "--summary-json",
            str(summary_path),
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "SyntaxError" in proc.stderr and "not restarting" in proc.stderr
    summary = json.loads(summary_path.read_text())
    assert [i["kind"] for i in summary["incidents"]] == ["syntax_error"]
    assert summary["restarts_used"] == 0
    assert len(list((tmp_path / "run" / "logs").glob("*/attempt_*"))) == 1, "exactly one attempt"


def test_restart_budget_is_enforced(tmp_path):
    proc, summary, out = launch(tmp_path, "--fault", "kill", run_args=("--max-restarts", "0"))
    assert proc.returncode != 0
    assert not (out / "result.json").exists()
    assert [i["kind"] for i in summary["incidents"]] == ["sigkill"] and summary["restarts_used"] == 0
    assert "restart budget used up (0/0)" in proc.stderr


def test_torchrun_flags_and_environment_as_torchrun(tmp_path):
    """A fault-free run with torchrun's own flags: same environment, same result, exit 0."""
    proc, summary, out = launch(
        tmp_path, run_args=("--max-restarts", "1", "--monitor-interval", "0.2", "--rdzv-id", "compat")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "result.json").read_text())["x"] == EXPECTED_X
    assert summary["incidents"] == [] and summary["restarts_used"] == 0
    assert {p.name for p in out.glob("attempt-*")} == {"attempt-rank0-0", "attempt-rank1-0"}

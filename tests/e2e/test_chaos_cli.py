"""`stalwart chaos` against a running `stalwart run` job, and worker incidents forwarded to the journal."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from stalwart import runtime
from stalwart.launch.client import MasterClient
from stalwart.launch.journal import Journal

from .test_run import SCRIPT

pytestmark = pytest.mark.e2e
STEPS = 60


def stalwart(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stalwart", *args], capture_output=True, text=True, timeout=timeout)


def wait_for(what: str, check, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def test_spec_is_printed_and_bad_input_exits_2():
    assert stalwart("chaos", "kill", "--rank", "1", "--at-step", "7").stdout.strip() == "kill:rank=1:step=7"
    assert stalwart("chaos", "slow", "--seconds", "0.5", "--print").stdout.strip() == "slow:seconds=0.5"
    for bad in (["slow"], ["kill", "--seconds", "1"], ["kill", "--at-step", "0"], ["explode"]):
        proc = stalwart("chaos", *bad)
        assert proc.returncode == 2 and "error" in proc.stderr, (bad, proc.stderr)
    missing = stalwart("chaos", "kill", "--run-dir", "/nonexistent/run")
    assert missing.returncode == 2 and "master.json" in missing.stderr


def test_injected_kill_recovers_and_worker_incidents_are_journaled(tmp_path, monkeypatch):
    run_dir, out = tmp_path / "run", tmp_path / "job"
    out.mkdir()
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stalwart",
            "run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--run-dir",
            str(run_dir),
            "--node-id",
            "n0",
            "--summary-json",
            str(tmp_path / "summary.json"),
            str(SCRIPT),
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--step-s",
            "0.15",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for("the master address", (run_dir / "master.json").exists)
        client = MasterClient(
            json.loads((run_dir / "master.json").read_text())["address"], (run_dir / "token").read_text().strip()
        )

        def step() -> int:
            return max(
                (r["step"] for n in client.status()["nodes"] for r in n["progress"].get("ranks", [])), default=-1
            )

        wait_for("training steps", lambda: step() >= 3)
        # A worker incident in two writes: the partial first line waits for its end.
        incidents = run_dir / "progress" / "n0" / "rank1.incidents.jsonl"
        rollback = json.dumps(
            {
                "time": time.time(),
                "rank": 1,
                "kind": "rollback",
                "class": "training",
                "step": 4,
                "detail": {"to_step": 2},
            }
        )
        with open(incidents, "a") as f:
            f.write(rollback[:30])
        time.sleep(1.5)
        assert client.status()["incidents"] == [], "half a line is not read"
        with open(incidents, "a") as f:
            f.write(rollback[30:] + "\n")
        wait_for("the rollback", lambda: any(i["kind"] == "rollback" for i in client.status()["incidents"]))
        # ... and one through the workers' own API, as rank 1 would call it.
        monkeypatch.setenv("STALWART_PROGRESS_DIR", str(incidents.parent))
        monkeypatch.setenv("RANK", "1")
        runtime.reset()  # the contract is read once per process (as in a freshly forked worker)
        try:
            assert runtime.incident("sdc", "hardware", step=5, evict=True)
        finally:
            runtime.reset()
        wait_for("the sdc", lambda: any(i["kind"] == "sdc" for i in client.status()["incidents"]))

        before = step()
        injected = stalwart("chaos", "kill", "--rank", "1", "--run-dir", str(run_dir), "--json")
        assert injected.returncode == 0, injected.stderr
        assert json.loads(injected.stdout)["spec"] == "kill:rank=1"
        _, err = job.communicate(timeout=180)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert job.returncode == 0, err[-4000:]
    assert json.loads((out / "result.json").read_text()) == {
        "step": STEPS,
        "x": sum(2 * s + 1 for s in range(1, STEPS + 1)),
    }
    rows = Journal(run_dir / "journal.sqlite").incidents()
    assert [r["kind"] for r in rows] == ["rollback", "sdc", "sigkill"]
    rollback_row, sdc_row, kill_row = rows
    assert rollback_row["class"] == "training" and rollback_row["details"]["to_step"] == 2
    assert rollback_row["details"]["rank"] == 1 and rollback_row["fault"] <= rollback_row["detected"]
    assert sdc_row["class"] == "hardware" and sdc_row["node_id"] == "n0"
    assert kill_row["fault"] <= kill_row["detected"] <= kill_row["first_step"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["restarts_used"] == 1 and summary["incidents"][0]["last_step"] >= before
    decisions = Journal(run_dir / "journal.sqlite").decisions()
    [evict] = [d for d in decisions if d["action"] == "evict"]
    assert evict["details"]["node_id"] == "n0" and evict["details"]["rank"] == 1
    assert [d["details"]["spec"] for d in decisions if d["action"] == "chaos"] == ["kill:rank=1"]

"""Several agents ("nodes") on this host with a separate `stalwart master`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.launch.client import MasterClient
from stalwart.utils.ports import free_port

from .hung import reaped
from .test_master import TOKEN, running_master, start_master
from .test_run import EXPECTED_X, SCRIPT

pytestmark = pytest.mark.e2e


def start_agents(
    tmp_path: Path, master: str, nodes: int, nproc: int, *script_args: str, window_s: float = 1.0
) -> list[subprocess.Popen]:
    port = free_port()
    (tmp_path / "job").mkdir(exist_ok=True)
    procs = []
    for n in range(nodes):
        cmd = [
            sys.executable,
            "-m",
            "stalwart",
            "run",
            "--nnodes",
            str(nodes),
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "mn",
            "--master",
            master,
            "--job-token",
            TOKEN,
            "--node-id",
            f"node{n}",
            "--max-restarts",
            "2",
            "--straggler-window",
            str(window_s),
            "--run-dir",
            str(tmp_path / f"run{n}"),
            "--summary-json",
            str(tmp_path / f"summary{n}.json"),
            str(SCRIPT),
            "--out",
            str(tmp_path / "job"),
            *script_args,
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> None:
    with reaped(*procs):
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err[-4000:]


def test_two_nodes_recover_from_a_killed_worker_with_one_restart(tmp_path):
    with running_master(tmp_path / "journal.sqlite", "--restart-budget", "2") as address:
        finish(start_agents(tmp_path, address, 2, 1, "--fault", "kill"))
        assert json.loads((tmp_path / "job" / "result.json").read_text())["x"] == EXPECTED_X
        status = MasterClient(address, TOKEN).status()
        assert status["restarts_used"] == 1, "both agents restart in one job-wide round"
        summaries = [json.loads((tmp_path / f"summary{n}.json").read_text()) for n in range(2)]
        causes = [i for s in summaries for i in s["incidents"] if not i["consequential"]]
        assert [(i["kind"], i["ranks"]) for i in causes] == [("sigkill", [1])]
        assert {n["node_id"] for n in status["nodes"]} == {"node0", "node1"}


def test_killed_master_does_not_disturb_training(tmp_path):
    port = free_port()
    db = tmp_path / "journal.sqlite"
    master, address = start_master(db, port)
    agents = start_agents(tmp_path, address, 1, 2, "--steps", "30", "--step-s", "0.15")
    try:
        client = MasterClient(address, TOKEN)
        deadline = time.monotonic() + 60
        while not client.status()["nodes"] and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        os.kill(master.pid, signal.SIGKILL)
        master.wait(10)
        time.sleep(1.5)
        master, _ = start_master(db, port)
        finish(agents)
        assert json.loads((tmp_path / "job" / "result.json").read_text())["step"] == 30
        status = client.status()
        assert status["master_starts"] == 2 and status["restarts_used"] == 0
        assert [n["node_id"] for n in status["nodes"]] == ["node0"]
        assert status["nodes"][0]["progress"]["ranks"], "heartbeats reached the restarted master"
        assert {p.name for p in (tmp_path / "job").glob("attempt-*")} == {"attempt-rank0-0", "attempt-rank1-0"}, (
            "workers were never restarted"
        )
    finally:
        master.terminate()
        master.wait(10)


def test_slow_node_is_flagged_as_straggler(tmp_path):
    with running_master(tmp_path / "journal.sqlite", "--straggler-windows", "3") as address:
        agents = start_agents(
            tmp_path, address, 2, 1, "--steps", "60", "--step-s", "0.05", "--slow-rank", "1", "--slow-factor", "3"
        )
        # 1-second windows so three of them pass well within the run.
        finish(agents)
        status = MasterClient(address, TOKEN).status()
        assert status["stragglers"] == ["node1"], status["stragglers"]
        [decision] = [d for d in status["decisions"] if d["action"] == "straggler"]
        assert decision["details"]["node_id"] == "node1" and decision["details"]["ratio"] > 2.0

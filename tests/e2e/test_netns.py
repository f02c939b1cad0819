"""Node loss for real: a node cut off the network, not killed.

node1 runs in its own network namespace, joined to this host's by a veth pair; the master (and the
rendezvous store it serves) and node0 listen on the host side. Taking the link down leaves node1's
processes alive but unreachable: node0's worker blocks in a collective that never completes (no
reset, as on a real partition), the hang detector stops it, the master declares node1 lost, and node0
goes on alone (`--nnodes 1:2`) once node1's rendezvous keep-alive expires. Needs root and `ip netns`;
skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from stalwart.checkpoint.node_job import NodeJob
from stalwart.launch.client import MasterClient
from stalwart.launch.journal import Journal

from .test_master import TOKEN, start_master
from .test_run import SCRIPT

pytestmark = pytest.mark.e2e
STEPS = 40


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces and veth pairs"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`)"
    probe = f"sw-probe-{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@pytest.fixture
def partition() -> Iterator[dict[str, str]]:
    """A namespace for node1 and a veth pair to the host: host side .1, namespace side .2."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    tag, net = uuid.uuid4().hex[:6], f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
    ns, host_if, ns_if = f"sw-{tag}", f"swh{tag}", f"swn{tag}"
    steps = [
        ("netns", "add", ns),
        ("link", "add", host_if, "type", "veth", "peer", "name", ns_if),
        ("link", "set", ns_if, "netns", ns),
        ("addr", "add", f"{net}.1/24", "dev", host_if),
        ("link", "set", host_if, "up"),
        ("-n", ns, "addr", "add", f"{net}.2/24", "dev", ns_if),
        ("-n", ns, "link", "set", ns_if, "up"),
        ("-n", ns, "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot build the veth link (`ip {' '.join(step)}`: {done.stderr.strip()})")
        yield {"ns": ns, "host_if": host_if, "ns_if": ns_if, "host_ip": f"{net}.1", "ns_ip": f"{net}.2"}
    finally:
        _ip("netns", "del", ns)  # takes the namespace's end of the pair, and so the pair, with it
        _ip("link", "del", host_if)


def start_node(
    tmp_path: Path, address: str, job: str, n: int, local_ip: str, ifname: str, ns: str | None = None
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "stalwart",
        "run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-id",
        job,
        "--local-addr",
        local_ip,
        "--rdzv-conf",
        "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
        "--master",
        address,
        "--job-token",
        TOKEN,
        "--node-id",
        f"node{n}",
        "--max-restarts",
        "3",
        "--hang-timeout",
        "3",
        "--run-dir",
        str(tmp_path / f"run{n}"),
        "--warm-start",
        "off",
        str(SCRIPT),
        "--out",
        str(tmp_path / "job"),
        "--steps",
        str(STEPS),
        "--step-s",
        "0.1",
    ]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": ifname}  # gloo's own address: on the veth, not the hostname's
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *cmd] if ns else cmd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / f"node{n}.log", "w"),
        start_new_session=True,
    )


def test_a_node_cut_off_the_network_is_lost_and_the_job_goes_on_without_it(tmp_path, partition):
    (tmp_path / "job").mkdir()
    job = f"netns-{uuid.uuid4().hex[:8]}"
    master, address = start_master(
        tmp_path / "journal.sqlite", 0, "--host", partition["host_ip"], "--rdzv-port", "0", "--node-timeout", "4"
    )
    client = MasterClient(address, TOKEN)
    nodes = [
        start_node(tmp_path, address, job, 0, partition["host_ip"], partition["host_if"]),
        start_node(tmp_path, address, job, 1, partition["ns_ip"], partition["ns_if"], partition["ns"]),
    ]
    try:
        deadline = time.monotonic() + 90
        while True:  # both nodes train: steps reported by a rank on each side of the link
            steps = {
                n["node_id"]: max((r["step"] for r in n["progress"].get("ranks", [])), default=-1)
                for n in client.status()["nodes"]
            }
            if len(steps) == 2 and min(steps.values()) >= 3:
                break
            assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), (
                tmp_path / "node1.log"
            ).read_text()[-3000:]
            time.sleep(0.2)
        cut = _ip("-n", partition["ns"], "link", "set", partition["ns_if"], "down")
        assert cut.returncode == 0, cut.stderr
        assert nodes[0].wait(timeout=150) == 0, (tmp_path / "node0.log").read_text()[-4000:]
        assert nodes[1].poll() is None or nodes[1].returncode != 0, "the cut-off node cannot have finished the job"
    finally:
        for p in nodes:
            if p.poll() is None:
                for proc in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
                    try:
                        proc.kill()
                    except psutil.NoSuchProcess:
                        pass
                p.wait(10)
        # the cut-off node is killed, its keeper with it: nobody else removes its directory (a beat file)
        shutil.rmtree(NodeJob.of_agent(job, "node1").root, ignore_errors=True)
        master.terminate()
        master.wait(10)
    assert json.loads((tmp_path / "job" / "state.json").read_text())["step"] == STEPS
    # node0 alone after the cut: its worker ran again as the only rank of a new round.
    attempts = sorted(p.name for p in (tmp_path / "job").glob("attempt-rank0-*"))
    assert len(attempts) >= 2, attempts
    journal = Journal(tmp_path / "journal.sqlite")
    decisions = journal.decisions()
    assert any(d["action"] == "node_lost" and d["details"]["node_id"] == "node1" for d in decisions), decisions
    hangs = [i for i in journal.incidents() if i["node_id"] == "node0" and i["kind"] == "hang"]
    assert hangs, "node0 saw its collective stall: the partition did not reset the connection"

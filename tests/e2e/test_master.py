"""The job master as a real process over real HTTP: auth, API, journal, restart-resume."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.launch.client import MasterClient, MasterError
from stalwart.utils.ports import free_port

from .hung import reaped

pytestmark = pytest.mark.e2e
TOKEN = "test-token-123"


def start_master(db: Path, port: int, *extra: str) -> tuple[subprocess.Popen, str]:
    ready = db.parent / f"ready-{time.monotonic_ns()}.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stalwart",
            "master",
            "--db",
            str(db),
            "--port",
            str(port),
            "--job-token",
            TOKEN,
            "--ready-file",
            str(ready),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "master did not start"
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["address"]


@contextlib.contextmanager
def running_master(db: Path, *extra: str, port: int = 0) -> Iterator[str]:
    """A master process for the duration of the block; yields its address."""
    proc, address = start_master(db, port, *extra)
    try:
        yield address
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def master(tmp_path):
    with running_master(tmp_path / "journal.sqlite", "--restart-budget", "2") as address:
        yield address


def raw(address: str, method: str, path: str, token: str | None, body: bytes | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(address + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_every_call_needs_the_token(master):
    for method, path, body in (
        ("GET", "/v1/status", None),
        ("POST", "/v1/nodes/join", b'{"node_id":"n","host":"h","nproc":1}'),
        ("POST", "/v1/restarts", b'{"reason":"x"}'),
        ("POST", "/v1/chaos", b'{"spec":"kill:rank=1"}'),
        ("GET", "/metrics", None),
        ("GET", "/v1/trace", None),
    ):
        assert raw(master, method, path, None, body) == 401
        assert raw(master, method, path, "wrong", body) == 403
    assert raw(master, "GET", "/v1/status", TOKEN) == 200
    status = MasterClient(master, TOKEN).status()
    assert status["nodes"] == [] and status["decisions"] == [], "rejected calls must change nothing"


def test_bad_requests_are_rejected_cleanly(master):
    assert raw(master, "POST", "/v1/nodes/join", TOKEN, b"not json") == 400
    assert raw(master, "POST", "/v1/nodes/join", TOKEN, b"[1, 2]") == 400
    assert raw(master, "POST", "/v1/nodes/join", TOKEN, b'{"node_id": 5, "host": "h", "nproc": 1}') == 400
    assert raw(master, "GET", "/v1/nope", TOKEN) == 404
    assert raw(master, "DELETE", "/v1/status", TOKEN) == 404
    # a 2 MiB body is refused from its Content-Length, before it is sent (the test sends none: a
    # client still writing when the server answers and closes could see a reset instead)
    conn = http.client.HTTPConnection(urllib.parse.urlparse(master).netloc, timeout=5)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Length": str(2 << 20)}
    conn.request("POST", "/v1/nodes/join", headers=headers)
    assert conn.getresponse().status == 413
    conn.close()
    client = MasterClient(master, TOKEN)
    with pytest.raises(MasterError) as err:
        client.heartbeat("ghost", {"step": 1})
    assert err.value.status == 404
    with pytest.raises(MasterError, match="unknown incident timestamps"):
        client.open_incident("kill", times={"whenever": 1.0})
    assert client.status()["job_id"] == "job"  # still serving


def test_membership_incidents_and_global_restart_budget(master):
    client = MasterClient(master, TOKEN)
    client.join("node-0", "hostA", 2, {"gpus": 0})
    client.join("node-1", "hostB", 2)
    client.heartbeat("node-0", {"step": 7, "phase": "train"})
    incident = client.open_incident("sigkill", node_id="node-1", cls="system", times={"fault": 10.0, "detected": 10.2})
    client.update_incident(incident, {"restarted": 11.0, "first_step": 12.5}, {"lost_steps": 1})
    # The budget is per job: two restarts from different nodes use it up.
    assert client.request_restart("worker died", "node-0")["allowed"]
    assert client.request_restart("worker died", "node-1")["allowed"]
    third = client.request_restart("worker died", "node-0")
    assert not third["allowed"] and third["used"] == 2 and third["budget"] == 2
    status = client.status()
    assert [n["node_id"] for n in status["nodes"]] == ["node-0", "node-1"]
    assert status["nodes"][0]["progress"] == {"step": 7, "phase": "train"}
    [inc] = status["incidents"]
    assert (inc["kind"], inc["class"], inc["fault"], inc["detected"], inc["restarted"], inc["first_step"]) == (
        "sigkill",
        "system",
        10.0,
        10.2,
        11.0,
        12.5,
    )
    assert inc["details"] == {"lost_steps": 1}
    assert [d["action"] for d in status["decisions"]] == ["restart", "restart", "give_up"]
    # the dashboard's trace download: the same events as `stalwart trace export` of the journal
    trace = client.call("GET", "/v1/trace")
    shown = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "incident"]
    assert shown == ["sigkill: fault", "sigkill: detected", "sigkill: restarted", "sigkill: first_step"]
    assert [e["name"] for e in trace["traceEvents"] if e.get("cat") == "decision"] == [
        "decision: restart",
        "decision: restart",
        "decision: give_up",
    ]


def test_killed_master_restarts_and_resumes_the_job(tmp_path):
    port = free_port()
    db = tmp_path / "journal.sqlite"
    proc, address = start_master(db, port)
    client = MasterClient(address, TOKEN, retry_for_s=30)
    client.join("node-0", "hostA", 1)
    incident = client.open_incident("hang", node_id="node-0", times={"fault": 1.0})
    beats, errors, stop = [], [], threading.Event()

    def agent() -> None:  # heartbeats straight through the master's death and restart
        step = 0
        while not stop.is_set():
            step += 1
            try:
                client.heartbeat("node-0", {"step": step})
                beats.append(step)
            except Exception as err:  # pragma: no cover - reported below
                errors.append(err)
            time.sleep(0.05)

    thread = threading.Thread(target=agent)
    thread.start()
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    before = len(beats)
    time.sleep(0.5)
    proc2, _ = start_master(db, port)
    try:
        deadline = time.monotonic() + 20
        while len(beats) < before + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        thread.join(30)
        assert not errors, errors
        assert len(beats) >= before + 5, "heartbeats did not resume after the master restart"
        status = client.status()
        assert status["master_starts"] == 2
        assert status["nodes"][0]["progress"]["step"] == beats[-1]
        assert status["incidents"][0]["id"] == incident and status["incidents"][0]["fault"] == 1.0
    finally:
        proc2.terminate()
        proc2.wait(10)


def test_silent_node_is_declared_lost(tmp_path):
    with running_master(tmp_path / "j.sqlite", "--node-timeout", "1") as address:
        client = MasterClient(address, TOKEN)
        client.join("node-0", "h", 1)
        client.join("node-1", "h", 1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            client.heartbeat("node-0", {"step": 1})
            states = {n["node_id"]: n["state"] for n in client.status()["nodes"]}
            if states["node-1"] == "lost":
                break
            time.sleep(0.2)
        assert states == {"node-0": "alive", "node-1": "lost"}
        assert any(
            d["action"] == "node_lost" and d["details"]["node_id"] == "node-1" for d in client.status()["decisions"]
        )


PRESENCE = """
import sys, time
from stalwart.launch.presence import Presence
p = Presence(sys.argv[1], sys.argv[2], sys.argv[3], keepalive_s=0.2).start()
print("open", flush=True)
if sys.argv[4] == "leave":
    time.sleep(0.5)
    p.close()
else:
    time.sleep(60)  # killed meanwhile: its process (and socket) gone
"""


def test_a_node_whose_agent_dies_is_lost_at_once_and_one_that_leaves_is_not(tmp_path):
    """Presence: an agent's held-open request breaking = its process is gone (long before a heartbeat
    timeout of 60 s here); an agent that closes it on purpose stays alive in the journal."""
    with running_master(tmp_path / "j.sqlite", "--node-timeout", "60") as address:
        client = MasterClient(address, TOKEN)
        for n in ("node-0", "node-1"):
            client.join(n, "h", 1, {"rdzv_node": ["h", 100 + int(n[-1]), 0]})
        procs = {
            n: subprocess.Popen([sys.executable, "-c", PRESENCE, address, TOKEN, n, how], stdout=subprocess.PIPE)
            for n, how in (("node-0", "die"), ("node-1", "leave"))
        }
        for p in procs.values():
            assert p.stdout.readline().strip() == b"open"
        time.sleep(0.5)  # both requests are being held by the master
        killed = time.time()
        procs["node-0"].kill()
        assert procs["node-1"].wait(10) == 0
        procs["node-0"].wait(10)
        deadline = time.monotonic() + 5
        while client.call("GET", "/v1/nodes/lost")["lost"] == [] and time.monotonic() < deadline:
            time.sleep(0.05)
        [lost] = client.call("GET", "/v1/nodes/lost")["lost"]
        assert lost["node_id"] == "node-0" and lost["rdzv_node"] == ["h", 100, 0]
        assert killed <= lost["lost_at"] < killed + 5
        states = {n["node_id"]: n["state"] for n in client.status()["nodes"]}
        assert states == {"node-0": "lost", "node-1": "alive"}, "a node that left on purpose is not lost"
        [decision] = [d for d in client.status()["decisions"] if d["action"] == "node_lost"]
        assert "connection to the master broke" in decision["reason"]
        client.heartbeat("node-0", {"step": 2})  # it was only cut off: a beat brings it back
        assert {n["node_id"]: n["state"] for n in client.status()["nodes"]}["node-0"] == "alive"
        assert raw(address, "POST", "/v1/nodes/presence?node_id=x", None, b"") == 401


def test_master_binds_loopback_by_default(tmp_path):
    with running_master(tmp_path / "j.sqlite") as address:
        assert address.startswith("http://127.0.0.1:")


def test_agents_of_one_failure_share_one_restart(master):
    client = MasterClient(master, TOKEN)
    first = client.request_restart("rank 1 died", "node-0", round_=0)
    second = client.request_restart("peer died", "node-1", round_=0)
    assert first["allowed"] and second["allowed"] and second.get("shared")
    assert client.status()["restarts_used"] == 1
    assert client.request_restart("again", "node-1", round_=1)["used"] == 2
    assert not client.request_restart("and again", "node-0", round_=2)["allowed"]  # budget 2
    assert not client.request_restart("peer", "node-1", round_=2)["allowed"]


def test_prometheus_metrics_from_the_journal(master):
    client = MasterClient(master, TOKEN)
    client.join("node-0", "hostA", 1)
    client.join("node-1", "hostB", 1)
    client.call(
        "POST",
        "/v1/nodes/heartbeat",
        {
            "node_id": "node-0",
            "progress": {
                "ranks": [{"rank": 0, "step": 41}],
                "window": {"compute_s": 0.25, "steps": 5},
                # the keeper's storage status, as the agent's heartbeat carries it (launch.storage_watch)
                "storage": {
                    "ok": False,
                    "cause": "full",
                    "failures": 4,
                    "last_committed": 20,
                    "last_commit_time": time.time() - 30,
                },
            },
        },
    )
    client.open_incident("sigkill", "node-1", "system", {"detected": time.time()})
    client.open_incident("sigkill", "node-1", "system", {"detected": time.time()})
    client.open_incident("sdc", "node-0", "hardware")
    client.request_restart("sigkill on rank 1", "node-1", 0)
    request = urllib.request.Request(master + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        text = response.read().decode()
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples['stalwart_nodes{state="alive"}'] == 2 and samples['stalwart_nodes{state="lost"}'] == 0
    assert samples['stalwart_incidents_total{class="system",kind="sigkill"}'] == 2
    assert samples['stalwart_incidents_total{class="hardware",kind="sdc"}'] == 1
    assert samples["stalwart_restarts_used"] == 1 and samples["stalwart_restart_budget"] == 2
    assert samples["stalwart_last_step"] == 41 and samples["stalwart_step_compute_seconds"] == 0.25
    assert samples['stalwart_decisions_total{action="restart"}'] == 1
    assert samples["stalwart_checkpoint_last_committed_step"] == 20
    assert 30 <= samples["stalwart_checkpoint_last_commit_age_seconds"] < 3600
    assert samples["stalwart_checkpoint_persist_failures_total"] == 4
    assert samples['stalwart_checkpoint_storage_failing{cause="full",node="node-0"}'] == 1


def test_injected_faults_are_journaled_and_delivered_with_heartbeats(master):
    client = MasterClient(master, TOKEN)
    client.join("node-0", "hostA", 1)
    with pytest.raises(MasterError, match="unknown action"):
        client.chaos("explode:rank=1")
    first, second = client.chaos("kill:rank=1:step=7"), client.chaos("hang:rank=0")
    beat = lambda after: client.call(
        "POST",
        "/v1/nodes/heartbeat",
        {"node_id": "node-0", "progress": {}, "chaos_after": after},
    )
    assert [c["spec"] for c in beat(0)["chaos"]] == ["kill:rank=1:step=7", "hang:rank=0"]
    assert [c["id"] for c in beat(first)["chaos"]] == [second] and beat(second)["chaos"] == []
    assert client.heartbeat("node-0", {})["chaos"] == [], "agents that do not ask get none"
    assert [d["details"]["spec"] for d in client.status()["decisions"] if d["action"] == "chaos"] == [
        "kill:rank=1:step=7",
        "hang:rank=0",
    ]


def test_a_straggler_is_evicted_only_when_a_spare_waits(tmp_path):
    with running_master(tmp_path / "j.sqlite", "--straggler-policy", "evict", "--straggler-windows", "2") as address:
        client = MasterClient(address, TOKEN)
        for n in range(2):
            client.join(f"node-{n}", "h", 1)

        def beat(node: str, member: bool, compute_s: float | None = None) -> dict:
            progress: dict = {"member": member}
            if compute_s is not None:
                progress["window"] = {"compute_s": compute_s, "steps": 5}
            return client.call("POST", "/v1/nodes/heartbeat", {"node_id": node, "progress": progress})

        beat("node-0", False)
        assert client.status()["spares"] == [], "outside a round that does not run yet: not a spare"
        for _ in range(3):  # node-1 is 3× slower for 3 windows, but nobody waits to replace it
            beat("node-0", True, 0.1)
            assert "leave" not in beat("node-1", True, 0.3)
        assert client.status()["stragglers"] == ["node-1"] and client.status()["evicted"] == []
        client.join("node-2", "h", 1)
        beat("node-2", False)
        status = client.status()
        assert (status["members"], status["spares"]) == (["node-0", "node-1"], ["node-2"])
        assert beat("node-1", True, 0.3)["leave"].startswith("straggler"), "a spare waits now: evicted"
        assert "leave" not in beat("node-0", True, 0.1) and "leave" not in beat("node-2", False)
        status = client.status()
        assert status["evicted"] == ["node-1"] and status["stragglers"] == []
        [evict] = [d for d in status["decisions"] if d["action"] == "evict"]
        assert evict["details"] == {
            "node_id": "node-1",
            "acted": True,
            "cause": "straggler",
            "ratio": evict["details"]["ratio"],
            "spares": ["node-2"],
        }
        assert beat("node-1", True)["leave"], "the evicted node hears it until it leaves"
        assert client.request_restart("peer left", "node-1", round_=0)["leave"]
        assert "leave" not in client.request_restart("peer left", "node-0", round_=0)
        client.join("node-1", "h", 1)  # repaired and back: welcome again
        assert "leave" not in beat("node-1", False)


def test_a_failed_precheck_evicts_the_node_and_a_slow_one_is_journaled(master):
    client = MasterClient(master, TOKEN)
    for n in range(3):
        client.join(f"node-{n}", "h", 1)
    check = lambda node, ok, s, *why: client.call(
        "POST",
        "/v1/nodes/precheck",
        {
            "node_id": node,
            "ok": ok,
            "matmul_s": s,
            "seconds": 0.2,
            "reasons": list(why),
            "devices": [],
        },
    )
    assert check("node-0", True, 0.001) == {"admit": True, "ratio": None}
    assert check("node-1", True, 0.0011)["admit"]
    verdict = check("node-2", False, 0.001, "local rank 0 (cpu): matmul result differs")
    assert not verdict["admit"] and "matmul result differs" in verdict["reason"]
    status = client.status()
    assert status["evicted"] == ["node-2"]
    [incident] = status["incidents"]
    assert (incident["node_id"], incident["kind"], incident["class"]) == ("node-2", "precheck", "hardware")
    [evict] = [d for d in status["decisions"] if d["action"] == "evict"]
    assert evict["details"]["cause"] == "precheck" and evict["details"]["incident"] == incident["id"]
    # 5× slower than the others: a straggler, journaled; admitted under the default policy (warn).
    assert check("node-1", True, 0.005)["admit"]
    assert [d["details"]["node_id"] for d in client.status()["decisions"] if d["action"] == "straggler"] == ["node-1"]
    with pytest.raises(MasterError, match="'ok' has the wrong type"):
        client.call("POST", "/v1/nodes/precheck", {"node_id": "node-0", "ok": "yes", "matmul_s": 0.001})


def test_a_node_that_keeps_failing_is_evicted_if_the_job_keeps_its_minimum(tmp_path):
    with running_master(tmp_path / "j.sqlite", "--evict-after-failures", "2") as address:
        client = MasterClient(address, TOKEN)
        for n in range(2):
            client.join(f"node-{n}", "h", 1, {"min_nodes": 2})
            client.heartbeat(f"node-{n}", {"member": True})
        fail = lambda node, **details: client.open_incident("sigkill", node, "system", details=details)
        fail("node-1")
        fail("node-0", consequential=True)  # a peer's failure caused by node-1's: not node-0's fault
        fail("node-1")
        assert client.status()["evicted"] == [], "without node-1 the job would fall below MIN = 2"
        client.join("node-2", "h", 1, {"min_nodes": 2})
        client.heartbeat("node-2", {"member": False})
        fail("node-1")
        fail("node-0", consequential=True)
        status = client.status()
        assert status["evicted"] == ["node-1"], status["decisions"]
        [evict] = [d for d in status["decisions"] if d["action"] == "evict"]
        assert evict["details"]["cause"] == "failures" and len(evict["details"]["incidents"]) == 3


def test_the_master_does_not_import_torch():
    """The master is a control plane: torch would cost it ~200 MiB of RSS and ~1 s of every (re)start
    (session 8's trace download pulled it in through observe.timers until a constant moved)."""
    code = "import sys, stalwart.launch.master, stalwart.commands.master; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


GONE_SCRIPT = """
import os, pathlib, sys, time
here = pathlib.Path(sys.argv[1])
with open(here / "attempts", "a") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"] + "\\n")
while not (here / "master_gone").exists():
    time.sleep(0.05)
sys.exit(3)
"""


def test_an_agent_whose_master_is_gone_restarts_from_its_own_budget_and_then_gives_up(tmp_path):
    """A master gone for good: each restart decision falls back to the node's --max-restarts, and the
    agent waits for the master --master-retry seconds in all, not per call. Before, the local budget was
    unbounded under `stalwart run` (the agent restarted without end) and every call waited 30 s."""
    script = tmp_path / "fails.py"
    script.write_text(GONE_SCRIPT)
    proc, address = start_master(tmp_path / "journal.sqlite", 0)
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "stalwart", "run", "--nnodes", "1", "--nproc-per-node", "1"),
            *("--master", address, "--job-token", TOKEN, "--node-id", "n0", "--run-dir", str(tmp_path / "run")),
            *("--max-restarts", "1", "--master-retry", "2", str(script), str(tmp_path)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    with reaped(agent, proc):
        deadline = time.monotonic() + 60
        while not (tmp_path / "attempts").exists():
            assert agent.poll() is None and time.monotonic() < deadline, "the first attempt did not start"
            time.sleep(0.05)
        proc.kill()
        proc.wait(10)
        gone = time.monotonic()
        (tmp_path / "master_gone").touch()
        err = agent.communicate(timeout=60)[1]
        ended = time.monotonic() - gone
    assert agent.returncode != 0, err[-3000:]
    assert "master unreachable: local budget used up; giving up" in err, err[-3000:]
    assert (tmp_path / "attempts").read_text().split() == ["0", "1"], "one restart: --max-restarts 1"
    assert ended < 20, f"the agent gave up {ended:.1f} s after the master went (it waits 2 s in all)"

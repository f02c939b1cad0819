"""How many agents can one job master serve? N simulated agents heartbeat at 1 Hz against the current
master (``stalwart master``: aiohttp on its own event loop, a SQLite write per heartbeat), in one run with
a baseline: the same load against a minimal asyncio HTTP server that answers at once, which shows what
the load generator itself can do on this machine.

    python benchmarks/control_plane.py [--json] [--agents 1000 2000] [--seconds 20]

Each agent is a coroutine of one asyncio load generator (its own process): agents start spread over
``--ramp-s``, join (retrying with backoff, as the agent's client does; failed attempts are reported as
join errors), then send a heartbeat every second (the first at a random offset in the first second),
each on a new connection, as the agent's urllib client does; a heartbeat counts as an error on a
connection error, a status other than 200, or no answer in 5 s. Reported per N: heartbeats answered
per second (offered: N/s), errors, p50/p99 latency of answered heartbeats (ms), and the master's peak
RSS (MiB, sampled every 0.5 s).
Issue #16 item 3's acceptance: 2,000 agents with p99 < 100 ms, 0 errors and RSS < 1 GiB (the master was
a stdlib ThreadingHTTPServer until session 7: p99 ≈ 1 s at 1,000 agents from its listen backlog of 5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

TOKEN = "bench-token"
TIMEOUT_S = 5.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--agents", type=int, nargs="+", default=[1000, 2000], help="agent counts (default 1000 2000)")
    p.add_argument("--seconds", type=float, default=20.0, help="heartbeat phase per count (default 20)")
    p.add_argument("--ramp-s", type=float, default=10.0, help="agents start spread over this (default 10)")
    p.add_argument("--target", choices=("master", "baseline", "both"), default="both")
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=1.0,
        help="seconds between an agent's beats (default 1; the master tells a job of N nodes max(1, N/1000) s)",
    )
    p.add_argument(
        "--restart-master-at",
        type=float,
        help="restart the master this many seconds into the heartbeat phase, on the same journal and "
        "port (SIGTERM, start again): does it resume the job, and how long are the agents without it?",
    )
    return p.parse_args(argv)


# -- servers ---------------------------------------------------------------------------------------
def start_master(work: Path, port: int = 0) -> tuple[subprocess.Popen[bytes], str]:
    ready = work / "ready.json"
    ready.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "stalwart", "master", "--db", str(work / "journal.sqlite"), "--port", str(port)]
    cmd += ["--job-token", TOKEN, "--ready-file", str(ready), "--node-timeout", "3600"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the master did not start")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["address"]


BASELINE = """
import asyncio, sys
BODY = b'{"ok":true}'
REPLY = (b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\nConnection: close\\r\\n"
         + b"Content-Length: %d\\r\\n\\r\\n" % len(BODY) + BODY)
async def handle(r, w):
    head = await r.readuntil(b"\\r\\n\\r\\n")
    n = next((int(l.split(b":")[1]) for l in head.split(b"\\r\\n") if l.lower().startswith(b"content-length")), 0)
    await r.readexactly(n)
    w.write(REPLY); await w.drain(); w.close()
async def main():
    s = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
    print(s.sockets[0].getsockname()[1], flush=True)
    await s.serve_forever()
asyncio.run(main())
"""


def start_baseline() -> tuple[subprocess.Popen[bytes], str]:
    proc = subprocess.Popen([sys.executable, "-c", BASELINE], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return proc, f"http://127.0.0.1:{int(proc.stdout.readline())}"


# -- load generator --------------------------------------------------------------------------------
async def post(port: int, path: str, body: dict[str, Any]) -> int:
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        await reader.read()  # to the end: the server closes
        return status
    finally:
        writer.close()


HEARTBEAT_S = [1.0]  # the agents' interval (--heartbeat-s)
answered: list[float] = []  # monotonic times of answered heartbeats (the restart's gap is read from them)


async def join(port: int, node: str, errors: list[tuple[float, str]]) -> bool:
    """Join with retries and backoff, as the agent's client does; failed attempts count as join errors."""
    deadline, delay = time.monotonic() + 120, 0.5
    while time.monotonic() < deadline:
        try:
            body = {"node_id": node, "host": "sim", "nproc": 8}
            if await asyncio.wait_for(post(port, "/v1/nodes/join", body), TIMEOUT_S) == 200:
                return True
        except Exception as err:
            errors.append((time.monotonic(), f"join {type(err).__name__}"))
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 8.0)
    return False


async def agent(
    port: int, i: int, n: int, ramp_s: float, seconds: float, lat: list[float], errors: list[tuple[float, str]]
) -> None:
    """Start at ``i/n`` of the ramp, join, then heartbeat at 1 Hz for ``seconds`` (from its own join)."""
    node = f"sim{i:05d}"
    await asyncio.sleep(ramp_s * i / n)
    if not await join(port, node, errors):
        return
    until = time.monotonic() + seconds
    await asyncio.sleep(random.random() * HEARTBEAT_S[0])
    body = {"node_id": node, "progress": {"step": 0}}
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            status = await asyncio.wait_for(post(port, "/v1/nodes/heartbeat", body), TIMEOUT_S)
            if status == 200:
                lat.append(time.monotonic() - t0)
                answered.append(time.monotonic())
            else:
                errors.append((time.monotonic(), f"status {status}"))
        except Exception as err:
            errors.append((time.monotonic(), type(err).__name__))
        await asyncio.sleep(max(0.0, HEARTBEAT_S[0] - (time.monotonic() - t0)))


def rss_mib(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


async def load(
    address: str, n: int, seconds: float, ramp_s: float, pid: int, restart: Any = None, restart_at: float = 0.0
) -> dict[str, Any]:
    """``restart``: a callable that restarts the server and returns its new pid (run ``restart_at``
    seconds after the ramp)."""
    port = int(address.rsplit(":", 1)[1])
    lat: list[float] = []
    errors: list[tuple[float, str]] = []
    answered.clear()
    pids, peak = [pid], [rss_mib(pid)]
    restarted: dict[str, float] = {}

    async def sample() -> None:
        while True:
            try:
                peak.append(rss_mib(pids[-1]))
            except psutil.NoSuchProcess:
                pass  # between a restart's stop and start
            await asyncio.sleep(0.5)

    async def restart_later() -> None:
        await asyncio.sleep(ramp_s + restart_at)
        restarted["stop"] = time.monotonic()
        pids.append(await asyncio.get_running_loop().run_in_executor(None, restart))
        restarted["up"] = time.monotonic()

    sampler = asyncio.create_task(sample())
    restarter = asyncio.create_task(restart_later()) if restart is not None else None
    await asyncio.gather(*(agent(port, i, n, ramp_s, seconds, lat, errors) for i in range(n)))
    sampler.cancel()
    lat.sort()
    kinds: dict[str, int] = {}
    for _, e in errors:
        kinds[e] = kinds.get(e, 0) + 1
    out: dict[str, Any] = {
        "agents": n,
        "heartbeats_per_s": len(lat) / seconds,
        "offered_per_s": n / HEARTBEAT_S[0],
        "errors": sum(1 for _, e in errors if not e.startswith("join")),
        "join_errors": sum(1 for _, e in errors if e.startswith("join")),
        "error_kinds": kinds,
        "p50_ms": 1000 * statistics.median(lat) if lat else None,
        "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else None,
        "rss_mib_peak": max(peak),
    }
    if restarter is not None:
        await restarter
        stop, up = restarted["stop"], restarted["up"]
        back = min((t for t in answered if t > up), default=None)
        after = [t for t in answered if up + 1 < t <= up + 3]  # every agent is still beating then
        out["restart"] = {
            "master_down_s": round(up - stop, 3),  # stop → the new master listening (its start-up)
            "agents_unanswered_s": None if back is None else round(back - stop, 3),
            "errors_during": sum(1 for t, e in errors if stop <= t <= up + TIMEOUT_S and not e.startswith("join")),
            "errors_after": sum(1 for t, e in errors if t > up + TIMEOUT_S and not e.startswith("join")),
            "beats_per_s_after": len(after) / 2,
        }
    return out


def measure(target: str, n: int, seconds: float, ramp_s: float, restart_at: float | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stalwart-cp-") as tmp:
        proc, address = start_master(Path(tmp)) if target == "master" else start_baseline()
        procs = [proc]

        def restart() -> int:
            procs[-1].terminate()
            procs[-1].wait(30)
            new, _ = start_master(Path(tmp), int(address.rsplit(":", 1)[1]))
            procs.append(new)
            return new.pid

        try:
            use = restart if restart_at is not None and target == "master" else None
            row = {"target": target, **asyncio.run(load(address, n, seconds, ramp_s, proc.pid, use, restart_at or 0))}
            if use is not None:  # the restarted master resumed the job: every agent known, alive, beating
                from stalwart.launch.client import MasterClient

                status = MasterClient(address, TOKEN, timeout_s=60).status()
                alive = sum(1 for node in status["nodes"] if node["state"] == "alive")
                row["restart"].update(master_starts=status["master_starts"], nodes_alive_after=alive)
            return row
        finally:
            procs[-1].terminate()
            procs[-1].wait(30)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    random.seed(0)
    HEARTBEAT_S[0] = args.heartbeat_s
    targets = ["master", "baseline"] if args.target == "both" else [args.target]
    rows = [measure(t, n, args.seconds, args.ramp_s, args.restart_master_at) for n in args.agents for t in targets]
    result = {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "seconds": args.seconds, "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        for r in rows:
            print(
                f"{r['target']:9s} N={r['agents']:6d} {r['heartbeats_per_s']:7.0f}/s answered "
                f"(offered {r['offered_per_s']:.0f}/s)  errors {r['errors']:6d} (joins {r['join_errors']})  "
                f"p50 {r['p50_ms'] or 0:7.1f} ms  "
                f"p99 {r['p99_ms'] or 0:7.1f} ms  RSS {r['rss_mib_peak']:6.0f} MiB  {r['error_kinds']}"
            )
            if "restart" in r:
                print(f"          restart: {r['restart']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

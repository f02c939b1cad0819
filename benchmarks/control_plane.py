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
    return p.parse_args(argv)


# -- servers ---------------------------------------------------------------------------------------
def start_master(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    ready = work / "ready.json"
    cmd = [sys.executable, "-m", "stalwart", "master", "--db", str(work / "journal.sqlite"), "--port", "0"]
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


async def join(port: int, node: str, errors: list[str]) -> bool:
    """Join with retries and backoff, as the agent's client does; failed attempts count as join errors."""
    deadline, delay = time.monotonic() + 120, 0.5
    while time.monotonic() < deadline:
        try:
            body = {"node_id": node, "host": "sim", "nproc": 8}
            if await asyncio.wait_for(post(port, "/v1/nodes/join", body), TIMEOUT_S) == 200:
                return True
        except Exception as err:
            errors.append(f"join {type(err).__name__}")
        await asyncio.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 8.0)
    return False


async def agent(port: int, i: int, n: int, ramp_s: float, seconds: float, lat: list[float], errors: list[str]) -> None:
    """Start at ``i/n`` of the ramp, join, then heartbeat at 1 Hz for ``seconds`` (from its own join)."""
    node = f"sim{i:05d}"
    await asyncio.sleep(ramp_s * i / n)
    if not await join(port, node, errors):
        return
    until = time.monotonic() + seconds
    await asyncio.sleep(random.random())
    body = {"node_id": node, "progress": {"step": 0}}
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            status = await asyncio.wait_for(post(port, "/v1/nodes/heartbeat", body), TIMEOUT_S)
            if status == 200:
                lat.append(time.monotonic() - t0)
            else:
                errors.append(f"status {status}")
        except Exception as err:
            errors.append(type(err).__name__)
        await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))


def rss_mib(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


async def load(address: str, n: int, seconds: float, ramp_s: float, pid: int) -> dict[str, Any]:
    port = int(address.rsplit(":", 1)[1])
    lat: list[float] = []
    errors: list[str] = []
    peak = [rss_mib(pid)]

    async def sample() -> None:
        while True:
            peak.append(rss_mib(pid))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(*(agent(port, i, n, ramp_s, seconds, lat, errors) for i in range(n)))
    sampler.cancel()
    lat.sort()
    kinds: dict[str, int] = {}
    for e in errors:
        kinds[e] = kinds.get(e, 0) + 1
    return {
        "agents": n,
        "heartbeats_per_s": len(lat) / seconds,
        "offered_per_s": n,
        "errors": sum(1 for e in errors if not e.startswith("join")),
        "join_errors": sum(1 for e in errors if e.startswith("join")),
        "error_kinds": kinds,
        "p50_ms": 1000 * statistics.median(lat) if lat else None,
        "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))] if lat else None,
        "rss_mib_peak": max(peak),
    }


def measure(target: str, n: int, seconds: float, ramp_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stalwart-cp-") as tmp:
        proc, address = start_master(Path(tmp)) if target == "master" else start_baseline()
        try:
            return {"target": target, **asyncio.run(load(address, n, seconds, ramp_s, proc.pid))}
        finally:
            proc.terminate()
            proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    random.seed(0)
    targets = ["master", "baseline"] if args.target == "both" else [args.target]
    rows = [measure(t, n, args.seconds, args.ramp_s) for n in args.agents for t in targets]
    result = {"cpus": os.cpu_count(), "load_avg": os.getloadavg(), "seconds": args.seconds, "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        for r in rows:
            print(
                f"{r['target']:9s} N={r['agents']:6d} {r['heartbeats_per_s']:7.0f}/s answered "
                f"(offered {r['offered_per_s']}/s)  errors {r['errors']:6d} (joins {r['join_errors']})  "
                f"p50 {r['p50_ms'] or 0:7.1f} ms  "
                f"p99 {r['p99_ms'] or 0:7.1f} ms  RSS {r['rss_mib_peak']:6.0f} MiB  {r['error_kinds']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

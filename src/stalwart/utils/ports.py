"""A free TCP port for a server that another process binds later (a rendezvous endpoint named before
the agents start, a daemon's port in a config file).

A port found by binding port 0 comes from the kernel's ephemeral range, which every outgoing
connection and every other ``bind(0)`` also draws from. Between finding it and the server binding it
(seconds: an agent imports torch first) another process may take it — and a c10d rendezvous whose
agents then fail to host the store join whatever store holds that port, and fail with it when its
owner ends (CI: both agents of one job lost "their" store at once). A port below the ephemeral range is
only ever taken by a process that asks for it by number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10_000  # below: well-known and registered services' ports
RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = map(int, RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port ``p`` such that ``p … p + count − 1`` are free on ``host`` now, chosen at random below the
    ephemeral range; from the kernel (``bind(0)``, one port) where that range leaves no room."""
    if count < 1:
        raise ValueError(f"free_port needs count ≥ 1, got {count}")
    top = ephemeral_range()[0] - count
    rng = random.SystemRandom()
    for _ in range(200 if top > LOWEST else 0):
        port = rng.randrange(LOWEST, top)
        if all(_bindable(host, port + i) for i in range(count)):
            return port
    while True:  # no room below the range: the kernel's choice (its successors checked)
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if all(_bindable(host, port + i) for i in range(1, count)):
            return port

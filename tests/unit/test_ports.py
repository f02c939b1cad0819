"""free_port: a port below the kernel's ephemeral range (where bind(0) and outgoing connections never
land), free now, its successors too when asked; the kernel's choice where the range leaves no room."""

from __future__ import annotations

import socket

import pytest

from stalwart.utils import ports


def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    low, _ = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_held_by_a_listener_is_never_given_and_count_gives_free_successors(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        pair = ports.free_port(count=2)  # below the range: nobody takes it meanwhile
        # Two candidates: the one before the held port (its successor is held), then a free pair.
        choices = iter([taken - 1, pair])
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, a, b: next(choices))
        assert ports.free_port(count=2) == pair


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST, 60999))
    port = ports.free_port()
    assert port >= ports.LOWEST
    with pytest.raises(ValueError, match="count ≥ 1"):
        ports.free_port(count=0)

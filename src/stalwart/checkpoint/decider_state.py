"""The checkpoint decider's state as JSON and back (the master's journal keeps it; a restarted master
resumes where the last one stopped): keys ``(step, epoch)`` become ``"step:epoch"`` strings."""

from __future__ import annotations

from typing import Any

from stalwart.checkpoint.decider import Decider
from stalwart.checkpoint.decider_events import Key

_PLAIN = ("epoch", "nodes", "max_attempts", "next_plan", "due", "passed", "latest", "lost", "settled", "ended")


def to_state(d: Decider) -> dict[str, Any]:
    """Everything the decider knows, as JSON-able values."""
    pins = {n: [list(k) for k in p] for n, p in d.pins.items()}
    seen = {n: list(s) for n, s in d.seen.items()}
    out = {f: getattr(d, f) for f in _PLAIN} | {"held": _dump(d.held), "pins": pins, "seen": seen}
    return out | {"plan": _plain(d.plan), "failure": _plain(d.failure)}


def from_state(state: dict[str, Any]) -> Decider:
    d = Decider(state["nodes"], state["epoch"], state["max_attempts"])
    for f in (f for f in _PLAIN if f in state):  # a journal of an earlier version lacks the newer ones
        setattr(d, f, list(state[f]) if f == "lost" else state[f])
    d.held, d.plan, d.failure = _load(state["held"]), _unplain(state["plan"]), _unplain(state["failure"])
    d.pins = {n: [tuple(k) for k in p] for n, p in state["pins"].items()}
    d.seen = {n: (s[0], s[1]) for n, s in state["seen"].items()}
    return d


def _dump(held: dict[str, dict[Key, list[int]]]) -> dict[str, dict[str, list[int]]]:
    return {n: {f"{k[0]}:{k[1]}": r for k, r in h.items()} for n, h in held.items()}


def _load(held: dict[str, dict[str, list[int]]]) -> dict[str, dict[Key, list[int]]]:
    return {n: {(int(k.split(":")[0]), int(k.split(":")[1])): list(r) for k, r in h.items()} for n, h in held.items()}


def _plain(d: dict[str, Any] | None) -> dict[str, Any] | None:  # a failure's final holdings as strings
    return d if d is None or "final" not in d else {**d, "final": _dump(d["final"])}


def _unplain(d: dict[str, Any] | None) -> dict[str, Any] | None:
    return d if d is None or "final" not in d else {**d, "final": _load(d["final"])}

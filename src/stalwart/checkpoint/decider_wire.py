"""The decider's events and decisions as JSON objects named by ``kind``, between keepers and its host
(docs/protocol.md), and its state (``to_state``/``from_state``: the master's journal, so a restarted master
resumes; keys ``(step, epoch)`` become ``"step:epoch"``). Decoding is strict — only kinds the caller may send,
every field with its exact type, none extra — so a bad report is refused with a message. Never pickle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint.decider import Decider
from stalwart.checkpoint.decider_events import Key

# What a keeper (or its agent) may report; NodeLost and EpochBegan are the decider host's own knowledge.
FROM_KEEPERS: tuple[type, ...] = (
    ev.Holding,
    ev.PersistDue,
    ev.Pinned,
    ev.Wrote,
    ev.Committed,
    ev.WorkersGone,
    ev.Preempted,
    ev.RolledBack,
    ev.JobEnded,
)
DECISIONS: tuple[type, ...] = (ev.Persist, ev.Write, ev.Commit, ev.GiveUp, ev.Release, ev.RestartMayProceed)


def _int(v: Any) -> int:
    if type(v) is not int:
        raise ValueError(f"{v!r} is not an integer")
    return v


def _typed(kind: type) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is not kind:
            raise ValueError(f"{v!r} is not a {kind.__name__}")
        return v

    return check


def _seq(item: Callable[[Any], Any]) -> Callable[[Any], tuple]:
    def convert(v: Any) -> tuple:
        if not isinstance(v, list | tuple):
            raise ValueError(f"{v!r} is not a list")
        return tuple(item(x) for x in v)

    return convert


def _optional(inner: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else inner(v)


def _held_entry(v: Any) -> tuple[int, int, tuple[int, ...], bool]:
    step, epoch, ranks, pinned = _fixed(v, 4)
    return _int(step), _int(epoch), _seq(_int)(ranks), _typed(bool)(pinned)


def _fixed(v: Any, n: int) -> tuple:
    if not isinstance(v, list | tuple) or len(v) != n:
        raise ValueError(f"{v!r} is not a list of {n}")
    return tuple(v)


def _key(v: Any) -> tuple[int, int]:
    step, epoch = _fixed(v, 2)
    return _int(step), _int(epoch)


# Field types as decider_events spells them (postponed annotations: strings).
_FIELDS: dict[str, Callable[[Any], Any]] = {
    "str": _typed(str),
    "int": _int,
    "bool": _typed(bool),
    "Held": _seq(_held_entry),
    "Key": _key,
    "Key | None": _optional(_key),
    "int | None": _optional(_int),
    "str | None": _optional(_typed(str)),
    "tuple[str, ...]": _seq(_typed(str)),
    "tuple[tuple[str, tuple[int, ...]], ...]": _seq(lambda p: (_typed(str)(_fixed(p, 2)[0]), _seq(_int)(p[1]))),
}


def to_json(message: Any) -> dict[str, Any]:
    """An event or decision as a JSON-able dict (tuples become lists on the wire)."""
    return {"kind": type(message).__name__, **dataclasses.asdict(message)}


def from_json(data: Any, allowed: Iterable[type]) -> Any:
    """The event or decision ``data`` names, if its kind is ``allowed``; ValueError says what is wrong."""
    kinds = {k.__name__: k for k in allowed}
    if not isinstance(data, dict) or data.get("kind") not in kinds:
        raise ValueError(f"not one of {sorted(kinds)}: {str(data)[:200]}")
    cls = kinds[data["kind"]]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if extra := set(data) - set(fields) - {"kind"}:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(extra)}")
    values = {}
    for name, field in fields.items():
        if name not in data:
            if field.default is dataclasses.MISSING:
                raise ValueError(f"{cls.__name__} needs {name!r}")
            continue
        try:
            values[name] = _FIELDS[str(field.type)](data[name])
        except (ValueError, TypeError) as err:
            raise ValueError(f"{cls.__name__}.{name}: {err}") from None
    return cls(**values)


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

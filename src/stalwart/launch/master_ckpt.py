"""The checkpoint decider, hosted by the job master (issue 30, item 1; docs/protocol.md).

The master knows the job's membership, so a lost node reaches the decider as an event the moment its
presence breaks (``NodeLost``), never as a timeout. Keepers speak to it through one authenticated call,
``POST /v1/ckpt``: ``{"node", "events": [...], "after": N}``. Their events go in (strictly decoded, a
keeper speaks only for its own node); the reply carries every decision numbered above ``after`` (without
one, a keeper's first call: those this call made; each keeper picks what concerns it), ``next``, the
number to send next time, and ``taken``: events before their execution formed here are not taken, and
are sent again. An execution forms when the nodes' ``Member`` reports for one epoch cover its world's
ranks: the first one creates the decider, each later one is its ``EpochBegan``; a ``Member`` from a
node's new agent with an epoch not above the decider's is a new launch (a requeue). The decider's state
and the recent decisions live in the journal, so a restarted master answers where the last one stopped.
"""

from __future__ import annotations

import logging
import threading
from http import HTTPStatus
from typing import Any

from stalwart.checkpoint import decider_events as ev
from stalwart.checkpoint import decider_wire as wire
from stalwart.checkpoint.decider import Decider
from stalwart.checkpoint.decider_wire import from_state, to_state
from stalwart.launch.api_error import ApiError
from stalwart.launch.journal import Journal

log = logging.getLogger("stalwart.master")
JOURNAL_KEY = "ckpt"
KEEP = 1000  # decisions kept for keepers that poll late; one further behind re-reports its holdings


class CheckpointDesk:
    """The decider and its outbox, behind one lock (HTTP handlers and the lost-node sweep call in)."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self._lock = threading.Lock()
        saved = journal.get(JOURNAL_KEY) or {}
        self.decider = from_state(saved["decider"]) if saved.get("decider") else None
        self.outbox: list[list[Any]] = saved.get("outbox", [])  # [number, decision as JSON]
        self.next: int = saved.get("next", 1)
        self.forming: dict[str, Any] = saved.get("forming", _forming())
        self.agents: dict[str, str] = saved.get("agents", {})  # node → the agent launch that formed its epoch
        self.retired: list[str] = saved.get("retired", [])  # agents of earlier launches: their word is late
        self.read: dict[str, int] = {}  # node → the newest decision it has been sent (not journaled)

    def exchange(self, body: dict[str, Any]) -> dict[str, Any]:
        node, after = body.get("node"), body.get("after")
        if not isinstance(node, str) or not node:
            raise ApiError(HTTPStatus.BAD_REQUEST, "field 'node' must name the reporting node")
        if (after is not None and type(after) is not int) or not isinstance(body.get("events", []), list):
            raise ApiError(HTTPStatus.BAD_REQUEST, "'after' must be an integer and 'events' a list")
        events = [self._decode(node, e) for e in body.get("events", [])]  # all or nothing
        with self._lock:
            reset = after is not None and after >= self.next  # it read numbers this journal never gave
            if after is None or reset:  # a keeper's first call: the decisions from this call on
                after = self.next - 1
            taken, changed = 0, False
            for event in events:
                if isinstance(event, dict):
                    self._member(node, event)
                    changed = True
                elif self.decider is None or getattr(event, "epoch", -1) > self.decider.epoch:
                    break  # its execution has not formed here yet: the keeper sends these again
                else:
                    decided = self._feed(event)
                    # A report of holdings that decides nothing is not journaled: the keepers report
                    # again at their next snapshot (every step), so a restarted master learns them anew.
                    changed = changed or decided > 0 or not isinstance(event, ev.Holding)
                taken += 1
            if changed:
                self._save()
            first = self.outbox[0][0] if self.outbox else self.next
            self.read[node] = self.next - 1
            return {
                "taken": taken,  # events taken in order; the rest came before every node's Member
                "decisions": [d for n, d in self.outbox if n > after],
                "next": self.next,
                "missed": reset or after + 1 < first,  # dropped before this keeper read them: report again
                "epoch": self.decider.epoch if self.decider else None,
            }

    def node_lost(self, node: str) -> None:
        """Membership lost ``node`` (its presence broke, or its heartbeats stopped)."""
        with self._lock:
            d = self.decider
            if d is None or node not in d.nodes or node in d.lost:
                return
            self._feed(ev.NodeLost(node, d.epoch))
            self._save()

    def all_read(self) -> bool:
        """Every node of the execution not lost has been sent every decision (a host about to go waits)."""
        with self._lock:
            d = self.decider
            return d is None or all(self.read.get(n, -1) >= self.next - 1 for n in d.nodes if n not in d.lost)

    def ranks_of(self, node: str) -> list[int]:
        """The ranks ``node`` reported for the newest execution it spoke of (forming, else formed)."""
        with self._lock:
            if node in self.forming["nodes"]:
                return list(self.forming["nodes"][node])
            return list(self.decider.nodes.get(node, [])) if self.decider else []

    def state(self) -> dict[str, Any] | None:
        with self._lock:
            return to_state(self.decider) if self.decider else None

    def _decode(self, node: str, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind") == "Member":
            return _member_report(data)
        try:
            event = wire.from_json(data, wire.FROM_KEEPERS)
        except ValueError as err:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"bad event: {err}") from None
        if getattr(event, "node", node) != node:
            raise ApiError(HTTPStatus.FORBIDDEN, f"node {node} reported for node {event.node}")
        return event

    def _member(self, node: str, report: dict[str, Any]) -> None:
        """``node`` runs ``ranks`` of a world of ``world`` in ``epoch``; a complete set forms it."""
        epoch, ranks, world, agent = report["epoch"], report["ranks"], report["world"], report["agent"]
        if agent and agent in self.retired:
            log.info("checkpoint decider: ignored node %s's membership from an earlier launch", node)
            return
        if self.decider is not None and epoch <= self.decider.epoch:
            known = {*self.agents.values(), *self.forming.get("agents", {}).values()}
            if not agent or agent in known:  # (a node joining the running launch reports a newer epoch)
                log.info("checkpoint decider: ignored node %s's late membership of epoch %d", node, epoch)
                return
            # A new agent whose rendezvous counts from 0 again: the job was launched anew (a requeue).
            log.warning(
                "checkpoint decider: node %s reports epoch %d from a new launch (epoch %d was the last one's); "
                "deciding for the new launch",
                node,
                epoch,
                self.decider.epoch,
            )
            self.retired = [*self.retired, *self.agents.values()][-KEEP:]
            self.decider, self.forming, self.agents = None, _forming(), {}
        if epoch > self.forming["epoch"]:
            self.forming = _forming(epoch, world)
        elif epoch < self.forming["epoch"]:
            return
        self.forming["nodes"][node] = ranks
        if agent:
            self.forming.setdefault("agents", {})[node] = agent
        covered = sorted(r for rs in self.forming["nodes"].values() for r in rs)
        if covered != list(range(self.forming["world"])):
            return
        nodes = self.forming["nodes"]
        self.agents = {**self.agents, **self.forming.get("agents", {})}
        if self.decider is None:
            self.decider = Decider(nodes, epoch)
            log.info("checkpoint decider: epoch %d formed with nodes %s", epoch, sorted(nodes))
        else:
            self._feed(ev.EpochBegan(epoch, tuple((n, tuple(r)) for n, r in sorted(nodes.items()))))
        self.forming = _forming(epoch)

    def _feed(self, event: Any) -> int:
        """Hand ``event`` to the decider; the number of decisions it made."""
        decisions = self.decider.handle(event)
        for decision in decisions:
            self.outbox.append([self.next, wire.to_json(decision)])
            self.next += 1
        for line in self.decider.log:
            log.info("checkpoint decider: %s", line)
        self.decider.log.clear()
        del self.outbox[:-KEEP]
        return len(decisions)

    def _save(self) -> None:
        self.journal.set(
            JOURNAL_KEY,
            {
                "decider": to_state(self.decider) if self.decider else None,
                "outbox": self.outbox,
                "next": self.next,
                "forming": self.forming,
                "agents": self.agents,
                "retired": self.retired,
            },
        )


def _forming(epoch: int = -1, world: int = 0) -> dict[str, Any]:
    return {"epoch": epoch, "world": world, "nodes": {}, "agents": {}}


def _member_report(data: dict[str, Any]) -> dict[str, Any]:
    """``{"kind": "Member", "epoch", "ranks", "world", "agent"?}``, checked."""
    epoch, ranks, world, agent = data.get("epoch"), data.get("ranks"), data.get("world"), data.get("agent", "")
    ok = type(epoch) is int and epoch >= 0 and type(world) is int and world > 0 and isinstance(ranks, list)
    if not ok or not ranks or not all(type(r) is int and 0 <= r < world for r in ranks):
        raise ApiError(HTTPStatus.BAD_REQUEST, "bad event: Member needs epoch ≥ 0, world > 0 and ranks in [0, world)")
    if not isinstance(agent, str) or len(agent) > 200:
        raise ApiError(HTTPStatus.BAD_REQUEST, "bad event: Member's 'agent' names the agent's launch (a string)")
    return {"epoch": epoch, "ranks": sorted(set(ranks)), "world": world, "agent": agent}

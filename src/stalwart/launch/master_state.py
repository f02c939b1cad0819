"""The job master's state and policies: what each API call does to the journal.

Separated from the HTTP plumbing (``master``) so it reads as the API it is and can be driven directly.
All state is in the journal (SQLite), so a restarted master resumes where the last one stopped.
"""

from __future__ import annotations

import logging
import threading
import time
from http import HTTPStatus
from typing import Any

from stalwart.launch import eviction
from stalwart.launch.api_error import ApiError
from stalwart.launch.autoscale import Autoscaler
from stalwart.launch.eviction import EvictionPolicy
from stalwart.launch.journal import Journal
from stalwart.launch.master_ckpt import CheckpointDesk
from stalwart.launch.recent_steps import RecentSteps
from stalwart.launch.stragglers import StragglerDetector

log = logging.getLogger("stalwart.master")


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
    if body.get(name) is None:
        if required:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"missing field {name!r}")
        return None
    value = body[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"field {name!r} has the wrong type")
    return value


def heartbeat_interval(nodes: int) -> float:
    """Seconds between an agent's heartbeats in a job of ``nodes``: 1 s up to 1,000 nodes, then one
    more second per 1,000 (≤ 1,000 beats/s at the master), at most 10 s. Liveness does not ride on it
    (``presence``); the node timeout must stay above a few intervals."""
    return float(min(10.0, max(1.0, nodes / 1000)))


class MasterState:
    """Request handling separated from HTTP plumbing, so it reads as the API it is."""

    def __init__(
        self,
        journal: Journal,
        job_id: str,
        restart_budget: int,
        node_timeout_s: float,
        stragglers: StragglerDetector | None = None,
        policy: EvictionPolicy | None = None,
        autoscaler: Autoscaler | None = None,
    ) -> None:
        self.journal = journal
        self.job_id = journal.get("job_id") or job_id
        journal.set("job_id", self.job_id)
        if journal.get("created") is None:
            journal.set("created", time.time())
        journal.set("restart_budget", restart_budget)
        self.node_timeout_s = node_timeout_s
        self.rdzv_endpoint: str | None = None  # set when the master serves the rendezvous store
        self._lock = threading.Lock()  # restart decisions: check-and-spend must be atomic
        self.stragglers = stragglers or StragglerDetector()
        self.policy = policy or EvictionPolicy()
        self.autoscaler = autoscaler or Autoscaler()
        self.started = time.time()  # this master process; heartbeats older than this are not counted
        self.compute_s: dict[str, float] = {}  # node → median compute seconds per step, last window
        self.recent_steps = RecentSteps()  # the ranks' newest section times: live section stragglers
        self.ckpt = CheckpointDesk(journal)  # the checkpoint decider: keepers report, it answers
        journal.set("master_starts", (journal.get("master_starts") or 0) + 1)

    def join(self, body: dict[str, Any]) -> dict[str, Any]:
        node_id = _field(body, "node_id", str)
        self.journal.join(
            node_id,
            _field(body, "host", str),
            _field(body, "nproc", int),
            _field(body, "info", dict, required=False) or {},
        )
        self.journal.set(f"evicted.{node_id}", None)  # a node that comes back (repaired) is welcome again
        return {"job_id": self.job_id, "heartbeat_s": heartbeat_interval(self.journal.node_count())}

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        node_id = _field(body, "node_id", str)
        progress = _field(body, "progress", dict, required=False) or {}
        known = self.journal.heartbeat(node_id, progress, _field(body, "info", dict, required=False))
        if not known:
            raise ApiError(HTTPStatus.NOT_FOUND, f"node {node_id!r} has not joined this job")
        self.recent_steps.note(node_id, progress.get("hist"))
        window = (body.get("progress") or {}).get("window")
        if isinstance(window, dict) and isinstance(window.get("compute_s"), (int, float)):
            self.compute_s[node_id] = float(window["compute_s"])
            flagged, ratio = self.stragglers.observe(node_id, float(window["compute_s"]))
            if flagged:
                self.journal.decide(
                    "straggler",
                    f"node {node_id} computes {ratio:.2f}× slower than the others for {self.stragglers.k} windows",
                    {"node_id": node_id, "ratio": ratio},
                )
            if node_id in self.stragglers.flagged and ratio is not None and self.policy.stragglers == "evict":
                self._evict_straggler(node_id, ratio)  # only while this window still compares it to peers
            step_s = window.get("step_s")
            self.autoscaler.observe(node_id, float(window["compute_s"]), step_s if isinstance(step_s, float) else None)
            self._autoscale()
        after = _field(body, "chaos_after", int, required=False)
        reply: dict[str, Any] = {"ok": True, "chaos": self.journal.chaos_after(after) if after is not None else []}
        leave = self.leave_reason(node_id)
        if leave:
            reply["leave"] = leave
        elif parked := self.journal.get(f"parked.{node_id}"):  # step out and wait as a spare (``park``)
            reply["park"] = parked
        return reply

    # -- eviction (the rules are in ``eviction``) -------------------------------------------------
    def leave_reason(self, node_id: Any) -> str | None:
        """Why `node_id` must leave the job, if it was evicted (its agent learns it from the reply)."""
        return self.journal.get(f"evicted.{node_id}") if isinstance(node_id, str) else None

    def evict(self, node_id: str, reason: str, details: dict[str, Any]) -> bool:
        """Take a node out of the job: journaled, and its agent told to leave; False if it already was."""
        with self._lock:
            if self.leave_reason(node_id) is not None:
                return False
            self.journal.set(f"evicted.{node_id}", reason)
            self.journal.set_node_state(node_id, "evicted")
        self.stragglers.forget(node_id)
        self.autoscaler.forget(node_id)
        self.journal.decide("evict", reason, {"node_id": node_id, "acted": True, **details})
        log.warning("evicted node %s: %s", node_id, reason)
        return True

    def _autoscale(self) -> None:
        """Re-size when the throughput model says so (``autoscale``): recommend, and under
        ``--autoscale on`` park the slowest node when fewer nodes train faster, or unpark a parked
        node when more do."""
        if not self.autoscaler.due():
            return
        nodes = self.journal.nodes()
        members = eviction.members(nodes, fresh_s=self.policy.fresh_s)
        info = [n["info"] for n in nodes if n["node_id"] in members]
        min_nodes = max((int(i.get("min_nodes") or 1) for i in info), default=1)
        max_nodes = min((int(i.get("max_nodes") or len(members)) for i in info), default=len(members))
        spares = eviction.spares(nodes, fresh_s=self.policy.fresh_s)
        rec = self.autoscaler.recommend(members, min_nodes, max_nodes, spares)
        parked = [n for n in spares if self.journal.get(f"parked.{n}")]
        acted = self.autoscaler.action(rec, members, parked=parked) if rec is not None else None
        if acted is None:
            return
        kind, node_id, details = acted
        if kind == "park":
            why = f"autoscale: {rec.best} nodes train {rec.gain:.0%} faster than {rec.current}; {node_id} is slowest"
        else:
            why = f"autoscale: {rec.best} nodes train {rec.gain:.0%} faster than {rec.current}; {node_id} rejoins"
        self.journal.set(f"parked.{node_id}", why if kind == "park" else None)
        self.journal.decide(kind, why, {"node_id": node_id, "acted": True, **details})
        log.warning("%s node %s: %s", kind, node_id, why)

    def _waiting_spares(self, nodes: list[dict[str, Any]], leaving: str) -> list[str]:
        return [n for n in eviction.spares(nodes, fresh_s=self.policy.fresh_s) if n != leaving]

    def _evict_straggler(self, node_id: str, ratio: float) -> None:
        waiting = self._waiting_spares(self.journal.nodes(), node_id)
        if waiting:
            self.evict(
                node_id,
                f"straggler ({ratio:.2f}× the others for {self.stragglers.k} windows); "
                f"spare {waiting[0]} takes its place",
                {"cause": "straggler", "ratio": ratio, "spares": waiting},
            )

    def precheck(self, body: dict[str, Any]) -> dict[str, Any]:
        """An agent's node check before it joins a rendezvous round: a failed one evicts the node; a slow
        one (against the other nodes' prechecks) is a straggler, evicted under the straggler policy."""
        node_id = _field(body, "node_id", str)
        ok, matmul_s = _field(body, "ok", bool), float(_field(body, "matmul_s", (int, float)))
        reasons = [str(r) for r in _field(body, "reasons", list, required=False) or []]
        details = {
            "matmul_s": matmul_s,
            "seconds": body.get("seconds"),
            "devices": body.get("devices"),
            "reasons": reasons,
            "source": "precheck",
        }
        nodes = self.journal.nodes()
        others = [
            p["matmul_s"]
            for n in nodes
            if n["node_id"] != node_id
            and isinstance(p := self.journal.get(f"precheck.{n['node_id']}"), dict)
            and p.get("ok")
        ]
        self.journal.set(f"precheck.{node_id}", {"matmul_s": matmul_s, "ok": ok, "time": time.time()})
        if not ok:
            incident = self.journal.open_incident(node_id, "precheck", "hardware", {"detected": time.time()}, details)
            reason = f"precheck failed on node {node_id}: {'; '.join(reasons) or 'no reason given'}"
            self.evict(node_id, reason, {"cause": "precheck", "incident": incident})
            return {"admit": False, "reason": reason}
        ratio = eviction.precheck_ratio(matmul_s, others)
        if ratio is not None and ratio > self.policy.precheck_slow_factor:
            self.journal.decide(
                "straggler",
                f"node {node_id}'s precheck matmul is {ratio:.2f}× the other nodes' median",
                {"node_id": node_id, "ratio": ratio, "source": "precheck"},
            )
            waiting = self._waiting_spares(nodes, node_id)
            if self.policy.stragglers == "evict" and waiting:
                reason = f"precheck {ratio:.2f}× slower than the other nodes; spare {waiting[0]} takes its place"
                self.evict(node_id, reason, {"cause": "precheck_slow", "ratio": ratio, "spares": waiting})
                return {"admit": False, "reason": reason}
        return {"admit": True, "ratio": ratio}

    def _count_failure(self, node_id: str | None, cls: str | None, details: dict[str, Any]) -> None:
        """--evict-after-failures: a node that keeps causing failures goes, if ≥ MIN nodes stay."""
        limit = self.policy.after_failures
        if not limit or not node_id or cls not in ("system", "hardware") or details.get("consequential"):
            return
        caused = [
            i
            for i in self.journal.incidents()
            if i["node_id"] == node_id
            and i["kind"] != "precheck"
            and i["class"] in ("system", "hardware")
            and not i["details"].get("consequential")
        ]
        if len(caused) >= limit and eviction.keeps_minimum(self.journal.nodes(), node_id, fresh_s=self.policy.fresh_s):
            self.evict(
                node_id,
                f"node {node_id} caused {len(caused)} failures (limit {limit})",
                {"cause": "failures", "incidents": [i["id"] for i in caused]},
            )

    def add_chaos(self, body: dict[str, Any]) -> dict[str, Any]:
        """Queue a fault for the running job; agents pick it up with their next heartbeat."""
        from stalwart.chaos import faults

        spec = _field(body, "spec", str)
        try:
            parsed = faults.parse(spec)
        except ValueError as err:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(err)) from None
        if not parsed or "\n" in spec:
            raise ApiError(HTTPStatus.BAD_REQUEST, "spec must be one line with at least one fault")
        chaos_id = self.journal.add_chaos(spec)
        self.journal.decide("chaos", f"fault injected: {spec}", {"spec": spec, "chaos_id": chaos_id})
        return {"id": chaos_id}

    def open_incident(self, body: dict[str, Any]) -> dict[str, Any]:
        node_id, cls = _field(body, "node_id", str, required=False), _field(body, "class", str, required=False)
        details = _field(body, "details", dict, required=False) or {}
        try:
            incident = self.journal.open_incident(
                node_id, _field(body, "kind", str), cls, _field(body, "times", dict, required=False) or {}, details
            )
        except ValueError as err:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(err)) from None
        self._count_failure(node_id, cls, details)
        return {"id": incident}

    def update_incident(self, incident_id: int, body: dict[str, Any]) -> dict[str, Any]:
        try:
            found = self.journal.update_incident(
                incident_id,
                _field(body, "times", dict, required=False) or {},
                _field(body, "details", dict, required=False),
            )
        except ValueError as err:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(err)) from None
        if not found:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no incident {incident_id}")
        return {"ok": True}

    def request_restart(self, body: dict[str, Any]) -> dict[str, Any]:
        """One restart from the job-wide budget (not per node: pytorch#108158). Every agent of a
        job fails together and asks for the same restart round; the first request decides the round
        and the others get the same answer without spending the budget again."""
        reason = _field(body, "reason", str)
        round_ = _field(body, "round", int, required=False)
        key = f"restart_round.{round_}" if round_ is not None else None
        with self._lock:
            leave = self.leave_reason(body.get("node_id"))  # an evicted node restarts nothing: it leaves
            if key is not None and (earlier := self.journal.get(key)) is not None:
                return {**earlier, "shared": True, **({"leave": leave} if leave else {})}
            budget = int(self.journal.get("restart_budget", 0))
            used = int(self.journal.get("restarts_used", 0))
            allowed = used < budget
            if allowed:
                used = self.journal.increment("restarts_used")
            answer = {"allowed": allowed, "used": used, "budget": budget}
            if key is not None:
                self.journal.set(key, answer)
            self.journal.decide(
                "restart" if allowed else "give_up", reason, {"node_id": body.get("node_id"), "round": round_, **answer}
            )
        return {**answer, "leave": leave} if leave else answer

    def decide(self, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.journal.decide(
                _field(body, "action", str), _field(body, "reason", str), _field(body, "details", dict, required=False)
            )
        }

    def status(self) -> dict[str, Any]:
        now = time.time()
        nodes = self.journal.nodes()
        for node in nodes:
            node["heartbeat_age_s"] = now - node["last_heartbeat"]
        fresh = self.policy.fresh_s
        return {
            "members": eviction.members(nodes, now, fresh),
            "spares": eviction.spares(nodes, now, fresh),
            "evicted": [n["node_id"] for n in nodes if n["state"] == "evicted"],
            "job_id": self.job_id,
            "created": self.journal.get("created"),
            "master_starts": self.journal.get("master_starts"),
            "restart_budget": self.journal.get("restart_budget"),
            "restarts_used": self.journal.get("restarts_used", 0),
            "stragglers": sorted(self.stragglers.flagged),
            "section_stragglers": self.recent_steps.flagged(
                {n["node_id"] for n in nodes if n["state"] == "alive"}, now
            ),
            "autoscale": {
                "mode": self.autoscaler.policy.mode,
                **(self.autoscaler.latest.to_dict() if self.autoscaler.latest else {}),
            },
            "rdzv_endpoint": self.rdzv_endpoint,
            "nodes": nodes,
            "incidents": self.journal.incidents(),
            "decisions": self.journal.decisions(),
        }

    def presence_lost(self, node_id: str) -> None:
        """The node's presence request broke without its final chunk (``presence``): its agent's
        process is gone. Lost now, as a heartbeat timeout would find it later; a beat revives it."""
        if not self.journal.mark_lost(
            node_id, time.time(), "its agent's connection to the master broke (process gone)"
        ):
            return  # unknown, evicted or already lost
        self.stragglers.forget(node_id)
        self.autoscaler.forget(node_id)
        self.ckpt.node_lost(node_id)
        log.warning("node %s lost: its presence connection broke", node_id)

    def lost(self) -> dict[str, Any]:
        """Nodes lost now, with when they were found lost (the survivors' question after a failure)."""
        return {
            "lost": [
                {
                    "node_id": n["node_id"],
                    "lost_at": self.journal.get(f"lost_at.{n['node_id']}"),
                    "rdzv_node": n["info"].get("rdzv_node"),
                    "ranks": self.ckpt.ranks_of(n["node_id"]),  # as its keeper reported them (Member)
                }
                for n in self.journal.nodes()
                if n["state"] == "lost"
            ]
        }

    def sweep(self) -> list[str]:
        """Mark nodes without a heartbeat for node_timeout_s as lost (after this master has been up
        that long, so a restarted master does not condemn nodes that were waiting for it)."""
        now = time.time()
        if now - self.started < self.node_timeout_s:
            return []
        lost = []
        for node in self.journal.nodes():
            silent = now - node["last_heartbeat"]
            if node["state"] == "alive" and silent > self.node_timeout_s:
                cutoff = now - self.node_timeout_s
                if self.journal.mark_lost(node["node_id"], now, f"no heartbeat for {silent:.1f} s", cutoff):
                    lost.append(node["node_id"])
                    self.ckpt.node_lost(node["node_id"])
        return lost

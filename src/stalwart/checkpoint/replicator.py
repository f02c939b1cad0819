"""Peer memory replicas, the sending side: the node's keeper copies the newest snapshot all of its
ranks hold into the shared memory of ``--replicas K`` other nodes, in the background (the wire and the
receiver: :mod:`.replicas`). Peers register in ``<storage>/.replicas/<node>.json``; a node pushes to the
next K live nodes in the ring of node ids. See docs/checkpoint.md, "Peer replicas" ("Where.").
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from stalwart.checkpoint.node_job import NodeJob, agreed
from stalwart.checkpoint.replicas import (
    ReplicaError,
    ReplicaServer,
    ReplicaStore,
    SlotSource,
    Superseded,
    background_priority,
    safe_name,
    send_copy,
)
from stalwart.checkpoint.shm import ENV_SLOTS, REPLICA_STATUS, SLOTS, atomic_write, complete_slots
from stalwart.checkpoint.storage import Storage
from stalwart.runtime import ENV_REPLICA_DOMAIN, ENV_REPLICA_HOST, ENV_REPLICA_KEY, ENV_REPLICA_SYNC, ENV_REPLICAS

log = logging.getLogger("stalwart.checkpoint.replicas")
REGISTRY = ".replicas"
FRESH_S = 30.0  # a registry entry that has not changed for this long (on the reader's clock) is a dead keeper's
REGISTER_EVERY_S = 10.0
PEERS_EVERY_S = 2.0
DOWN_S = 5.0
SILENT_S = 600.0  # a source that pushed nothing for this long is gone (lost, evicted): its copies are freed
PIN_AFTER = 3  # copies overwritten this many times in a row: pin the next one (its snapshot moves over)
BEAT_FILE = "replicas.beat"  # touched every second while the replicator runs (workers under --replica-sync wait)
BEAT_S = 1.0


@dataclass(frozen=True)
class ReplicaConfig:
    copies: int
    host: str
    domain: str
    key: bytes  # the job token
    sync: bool = False  # the workers wait for each copy (``--replica-sync``): look for new snapshots often

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ReplicaConfig | None:
        """What ``stalwart run`` asked of this keeper; None when replicas are off or impossible."""
        env = dict(os.environ) if env is None else env
        copies = int(env.get(ENV_REPLICAS) or 0)
        if copies <= 0:
            return None
        key = env.get(ENV_REPLICA_KEY, "")
        if not key:
            log.warning("replicas asked for but no job token given to the keeper: no peer replicas")
            return None
        host, domain = env.get(ENV_REPLICA_HOST) or "127.0.0.1", env.get(ENV_REPLICA_DOMAIN, "")
        return cls(copies, host, domain, key.encode(), sync=bool(env.get(ENV_REPLICA_SYNC)))


def choose_peers(me: str, domain: str, entries: list[dict[str, Any]], down: set[str]) -> list[dict[str, Any]]:
    """Candidates in push order: the nodes after ``me`` in the ring of ids (so each node's copies go
    to different nodes), another failure domain before ours; never ``me`` nor a node ``down``."""
    others = [e for e in entries if e.get("node") != me and e.get("node") not in down]
    ring = sorted(others, key=lambda e: (str(e["node"]) < me, str(e["node"])))
    return sorted(ring, key=lambda e: bool(domain) and e.get("domain") == domain)


class Replicator:
    """Serves other nodes' pushes into this node's job directory and pushes this node's snapshots."""

    def __init__(self, node: NodeJob, config: ReplicaConfig, poll_s: float | None = None) -> None:
        self.node, self.config = node, config
        self.poll_s = poll_s if poll_s is not None else 0.002 if config.sync else 0.02
        self.me = safe_name(node.root.name)
        self.store = ReplicaStore(node.root, config.key)
        self.server = ReplicaServer(config.host, self.store).start()
        self.pushed_step = -1
        self.skipped_step = -1  # the newest step said to be left without copies (the waiting workers go on)
        self.down: dict[str, float] = {}
        self.failing: set[str] = set()  # peers whose failure was logged (once, until they answer again)
        self.superseded_in_a_row = 0
        self.slots = int(os.environ.get(ENV_SLOTS) or len(SLOTS))  # the workers' snapshot slots
        self._lag_warned = 0.0
        self._idle_until = 0.0
        self.status: dict[str, Any] = {
            "node": self.me,
            "address": f"{config.host}:{self.server.port}",
            "copies": config.copies,
            "pushed_step": None,
            "pushed_to": [],
            "pushes": 0,
            "push_failures": 0,
            "last_push_s": None,
        }
        self._storage: Storage | None = None
        self._registered, self._registrations = 0.0, 0
        # node → (its entry's (pid, beat), when this reader first saw that value: monotonic). Freshness is
        # a change seen on this node's clock: registry entries carry counters, no times to compare.
        self._seen: dict[str, tuple[tuple[Any, Any], float]] = {}
        self._peers: list[dict[str, Any]] = []
        self._peers_read = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="stalwart-replicator", daemon=True)
        self._thread.start()
        self._beat_thread = threading.Thread(target=self._beat, name="stalwart-replicator-beat", daemon=True)
        self._beat_thread.start()
        log.info("replicas: serving %s, %d copies of this node's snapshots", self.status["address"], config.copies)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._beat_thread.join(timeout=10)
        (self.node.root / BEAT_FILE).unlink(missing_ok=True)
        self.server.shutdown()
        self.server.server_close()
        if self._storage is not None:
            try:
                self._storage.fs.rm(self._storage.path(REGISTRY, f"{self.me}.json"))
            except (OSError, FileNotFoundError):
                pass

    # -- the loop -------------------------------------------------------------------------------------
    def _beat(self) -> None:
        """Say that copies are being made, also while a long push keeps the loop busy: a worker waiting
        for a copy (``--replica-sync``) waits as long as this file is fresh."""
        beat = self.node.root / BEAT_FILE
        while True:
            try:
                beat.touch(mode=0o600)  # updates the time of an existing file
            except OSError:
                pass  # the job directory is being removed: the keeper is ending
            if self._stop.wait(BEAT_S):
                return

    def _loop(self) -> None:
        background_priority()
        while not self._stop.wait(self.poll_s):
            if time.monotonic() < self._idle_until or not self.node.spans_nodes():
                continue  # a single-node job has no peers: no registry, no copies
            storage = self._current_storage()
            if storage is None:
                continue
            try:  # a storage outage keeps the last known peers: their memory may be all that is left
                now = time.monotonic()
                if now - self._registered > REGISTER_EVERY_S:
                    self._register(storage)
                    self.store.prune_silent(SILENT_S)
                if now - self._peers_read > PEERS_EVERY_S:
                    self._peers, self._peers_read = self._read_peers(storage), now
            except Exception as err:
                log.warning("replicas: peer registry at %s: %r", storage.url, err)
                self._registered = self._peers_read = time.monotonic()  # retried in 10 s and 2 s
            try:
                self._push_newest()
            except Exception as err:  # the keeper's persists must go on whatever happens here
                log.warning("replicas: %r", err)
                self._idle_until = time.monotonic() + 1.0

    def _current_storage(self) -> Storage | None:
        job = self.node.job()
        url = job.get("storage")
        if not url:
            return None
        if self._storage is None or self._storage.url != url:
            self._storage, self._registered = Storage(url, job.get("storage_options")), 0.0
        return self._storage

    def _register(self, storage: Storage) -> None:
        entry = {"node": self.me, "host": self.config.host, "port": self.server.port}
        self._registrations += 1
        entry.update(domain=self.config.domain, beat=self._registrations, pid=os.getpid())
        if storage.local:
            storage.fs.makedirs(storage.path(REGISTRY), exist_ok=True)
        storage.write_atomic(json.dumps(entry).encode(), REGISTRY, f"{self.me}.json")
        self._registered = time.monotonic()

    def _read_peers(self, storage: Storage) -> list[dict[str, Any]]:
        storage.refresh()
        try:
            names = storage.fs.ls(storage.path(REGISTRY), detail=False)
        except (FileNotFoundError, OSError):
            return []
        peers = []
        for name in names:
            text = storage.read_text(REGISTRY, os.path.basename(str(name)))
            try:
                entry = json.loads(text) if text else None
            except json.JSONDecodeError:
                continue
            if isinstance(entry, dict) and self._fresh(entry):
                peers.append(entry)
        return peers

    def _fresh(self, entry: dict[str, Any]) -> bool:
        """An entry whose keeper re-registered within FRESH_S of this node's clock (first seen: fresh)."""
        value, now = (entry.get("pid"), entry.get("beat")), time.monotonic()
        seen = self._seen.get(str(entry.get("node")))
        if seen is None or seen[0] != value:
            self._seen[str(entry.get("node"))] = seen = (value, now)
        return now - seen[1] < FRESH_S

    def _push_newest(self) -> None:
        world = int(self.node.job().get("world_size") or 0) or self.node.world()  # job.json: the current world
        if not world or not self.node.spans_nodes():
            return
        ranks = self.node.node_ranks(world)
        held = self.node.snapshot_steps(world, ranks)
        step = max(agreed(held), default=-1)
        if step < max(self.pushed_step, self.skipped_step):  # a restore went back (its later snapshots are
            self.pushed_step = self.skipped_step = -1  # gone): push again from here
        if step <= self.pushed_step:
            return
        times = {str(r): held[r][step].get("time") for r in ranks} if step >= 0 else {}  # whose snapshots
        if not self._candidates():
            self._skip(step, times, "no peer")  # nobody to copy to (yet): copying the state out would be wasted
            return
        t0, sent = time.perf_counter(), set()
        for r in ranks:
            slot = next((s for s in complete_slots(self.node.paths, r) if s.step == step), None)
            try:
                if slot is None:
                    raise Superseded(f"rank {r} no longer holds step {step}")
                with SlotSource(self.node.paths, slot, pin=self.superseded_in_a_row >= PIN_AFTER) as source:
                    to = self._send(source, ranks, step)
            except Superseded:
                self.superseded_in_a_row += 1
                self.status["superseded"] = self.status.get("superseded", 0) + 1
                return  # the writer is ahead: push its newer step instead
            if not to:
                self._idle_until = time.monotonic() + 1.0  # every candidate failed: not 50 copies a second
                self._skip(step, times, "no peer took the copy")
                return
            sent.update(to)
        self.superseded_in_a_row = 0
        self.pushed_step = step
        lag = max(agreed(self.node.snapshot_steps(world, ranks)), default=step) - step
        if lag >= self.slots and time.monotonic() - self._lag_warned > 60:
            self._lag_warned = time.monotonic()
            log.warning(
                "replicas: the copy of step %d arrived %d steps behind the snapshots (%.2f s per push): the "
                "survivors keep %d, so a node lost now would restore from storage; pushes need a faster "
                "network or CPU, or fewer bytes per node",
                *(step, lag, time.perf_counter() - t0, self.slots),
            )
        self.status.update(
            lag_steps=lag,
            pushed_step=step,
            pushed_times=times,
            pushed_to=sorted(sent),
            pushes=self.status["pushes"] + 1,
            last_push_s=round(time.perf_counter() - t0, 4),
            received=self.store.received,
            refused=self.store.refused,
        )
        atomic_write(self.node.root / REPLICA_STATUS, json.dumps(self.status).encode())

    def _skip(self, step: int, times: dict[str, Any], why: str) -> None:
        """Say (once per step) that ``step`` gets no copy: workers waiting for it (``--replica-sync``)
        go on. ``times``: each rank's snapshot time, so a worker takes no news of an older snapshot."""
        if step > self.skipped_step:
            self.skipped_step = step
            self.status.update(skipped_step=step, skipped_times=times, skipped_why=why)
            atomic_write(self.node.root / REPLICA_STATUS, json.dumps(self.status).encode())

    def _candidates(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return choose_peers(
            self.me, self.config.domain, self._peers, {n for n, t in self.down.items() if now - t < DOWN_S}
        )

    def _send(self, source: SlotSource, ranks: list[int], step: int) -> list[str]:
        """Push one rank's slot to the first ``copies`` peers that take it; the ones that did."""
        sent: list[str] = []
        for peer in self._candidates():
            if len(sent) >= self.config.copies:
                break
            try:
                send_copy((peer["host"], int(peer["port"])), self.config.key, self.me, ranks, source)
            except Superseded:
                raise  # the slot's fault, not the peer's
            except (OSError, ReplicaError, ValueError) as err:
                if peer["node"] not in self.failing:
                    log.warning("replicas: push of step %d to %s failed: %s", step, peer["node"], err)
                    self.failing.add(peer["node"])
                self.down[peer["node"]] = time.monotonic()
                self.status["push_failures"] += 1
                continue
            if peer["node"] in self.failing:
                log.info("replicas: %s takes copies again", peer["node"])
                self.failing.discard(peer["node"])
            self.down.pop(peer["node"], None)
            sent.append(peer["node"])
        if sent and len(sent) < self.config.copies and self.pushed_step < 0:
            log.warning("replicas: only %d of %d peers reachable for step %d", len(sent), self.config.copies, step)
        return sent

"""The checkpoint decider of a job with no master that every node shares: hosted by rank 0's keeper.

Under ``stalwart run --master`` (or Slurm's) the decider lives in the job master. Plain ``torchrun``
across nodes has no master, and ``stalwart run`` without ``--master`` starts one per node, which hears
its own node only. There rank 0's keeper serves the same ``CheckpointDesk`` behind the same
authenticated handler (a :class:`~stalwart.launch.master.Master` of its own: journal in the node's job
directory, a fresh token, bound to the address the workers' rendezvous store has on this node) and puts
``{address, token}`` under :data:`STORE_KEY` in that store (``MASTER_ADDR:MASTER_PORT``, which the
workers write into ``job.json``); the other keepers read it there. Storage still carries no
coordination, and the token travels only through the store, which the job's processes trust already.

The workers' store may be fresh at every restart (``stalwart run`` hosts one per round): the host puts
its address into each new one. Without a master nothing says a node is lost: a lost node's plans end
when the next execution forms (its keepers report their ranks), not before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from datetime import timedelta
from typing import Any

from stalwart import runtime
from stalwart.checkpoint.membership import Membership
from stalwart.checkpoint.shm import JobPaths

log = logging.getLogger("stalwart.checkpoint")
STORE_KEY = "stalwart/ckpt-desk"
LOOK_EVERY_S = 0.1  # a keeper looks for the desk's address at most this often
DESK_DB = "desk.sqlite"


def node_name(paths: JobPaths) -> str:
    """This keeper's node id: the agent's under ``stalwart run``; else the host and job directory (two
    "nodes" on one host keep their snapshots in different roots)."""
    given = os.environ.get(runtime.ENV_NODE_ID, "")
    return given or f"{socket.gethostname()}-{hashlib.sha1(str(paths.root).encode()).hexdigest()[:8]}"


def _store(address: str) -> Any:
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=1), wait_for_workers=False)


class DeskHost:
    """One keeper's way to the decider: host it (rank 0's node) or find it in the workers' store."""

    def __init__(self, paths: JobPaths, agent: str = "") -> None:
        self.paths, self.agent, self.node = paths, agent, node_name(paths)
        self.master: Any = None  # the hosted Master (rank 0's keeper)
        self._token = ""  # its token, fresh for each host
        self.published: str | None = None  # the store it put its address into last
        self._looked = -float("inf")

    def members(self, job: dict[str, Any], coordinator: bool, every_s: float = LOOK_EVERY_S) -> Membership | None:
        """The line to the decider once known (None: not yet; called again at the next pass), read from
        the store at most every ``every_s``."""
        store = job.get("store")
        if not store:
            return None
        if coordinator:
            self._host(store)
            self.republish(job)
            return Membership(self.master.address, self._token, self.node, agent=self.agent)
        if time.monotonic() - self._looked < every_s:
            return None
        self._looked = time.monotonic()
        try:
            desk = _store(store)
            if not desk.check([STORE_KEY]):
                return None
            found = json.loads(desk.get(STORE_KEY))
        except (OSError, RuntimeError, ValueError, KeyError) as err:  # the store is between rounds
            log.debug("checkpoint desk: store %s not readable yet (%s)", store, err)
            return None
        return Membership(found["address"], found["token"], self.node, agent=self.agent)

    def republish(self, job: dict[str, Any]) -> None:
        """The host puts its address into every new store the workers name (a restart's)."""
        store = job.get("store")
        if self.master is None or not store or store == self.published:
            return
        if time.monotonic() - self._looked < LOOK_EVERY_S:
            return
        self._looked = time.monotonic()
        try:
            _store(store).set(STORE_KEY, json.dumps({"address": self.master.address, "token": self._token}))
            self.published = store
        except (OSError, RuntimeError) as err:
            log.debug("checkpoint desk: store %s not writable yet (%s)", store, err)

    def _host(self, store: str) -> None:
        if self.master is not None:
            return
        from stalwart.launch.master import Master, new_token

        self._token = new_token()
        host = store.rpartition(":")[0] or "127.0.0.1"
        try:  # where the workers' store is reached on this node: the other nodes reach it
            master = Master(self.paths.root / DESK_DB, self._token, host=host, job_id="ckpt-desk")
        except OSError:  # a name that does not resolve to this host's own address
            log.warning("checkpoint desk: cannot bind %s; listening on every interface (token-protected)", host)
            master = Master(self.paths.root / DESK_DB, self._token, host="0.0.0.0", job_id="ckpt-desk")
        os.chmod(self.paths.root / DESK_DB, 0o600)
        self.master = master.start()

    def close(self, wait_s: float = 5.0) -> None:
        """Stop hosting once every node has been sent every decision (the final commit's release among
        them: a node that never hears it waits for it), ``wait_s`` at most."""
        if self.master is None:
            return
        deadline = time.monotonic() + wait_s
        while not self.master.state.ckpt.all_read() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.master.stop()
        self.master = None

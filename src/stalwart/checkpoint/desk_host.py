"""Where a keeper finds the checkpoint decider (docs/checkpoint.md, "Jobs that span nodes"). Without a
master every node shares, rank 0's keeper serves the same ``CheckpointDesk`` and handler (a ``Master`` of
its own) and puts ``{address, token}`` under :data:`STORE_KEY` in the workers' rendezvous store, which the
job's processes trust already. :class:`Membership`: the decider's address, and this node's report there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from stalwart import runtime
from stalwart.checkpoint.shm import JobPaths
from stalwart.runtime.master_call import MasterError, call_master

log = logging.getLogger("stalwart.checkpoint")
STORE_KEY = "stalwart/ckpt-desk"
LOOK_EVERY_S = 0.1  # a keeper looks for the desk's address at most this often
DESK_DB = "desk.sqlite"


def node_name(paths: JobPaths) -> str:
    """This keeper's node id: the agent's under ``stalwart run``, else host and job directory (two per host)."""
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
        """The line to the decider once known (None: not yet), read from the store at most every ``every_s``."""
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


class Membership:
    """Where the decider is (address, token) and ``me``: this keeper's node id, which reports its ranks."""

    def __init__(self, address: str, token: str, me: str, every_s: float = 0.2, agent: str = "") -> None:
        self.address, self.token, self.me, self.every_s = address.rstrip("/"), token, me, every_s
        self.agent = agent  # this launch of the node's agent (``runtime.ENV_AGENT``): a requeue is a new one
        self._reported: tuple[int, list[int], int] | None = None  # (epoch, ranks, world) the master has
        self._report_tried = -float("inf")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Membership | None:
        """The keeper's under ``stalwart run`` with a master every node shares (master, job token and node
        id in its environment); None otherwise (``desk_host``: rank 0's keeper decides)."""
        env = os.environ if env is None else env
        address, token, me = (env.get(k, "") for k in (runtime.ENV_MASTER, runtime.ENV_JOB_TOKEN, runtime.ENV_NODE_ID))
        if not (address and token and me and env.get(runtime.ENV_SHARED_MASTER) == "1"):
            return None
        log.info("node %s: the checkpoint decider is the job master's, at %s", me, address)
        return cls(address, token, me, agent=env.get(runtime.ENV_AGENT, ""))

    def report_member(self, epoch: int, ranks: list[int], world: int, agent: str = "") -> None:
        """Tell the decider (once per execution; a failed try again after ``every_s``) that this node runs
        ``ranks`` of ``world`` in ``epoch``: every node's report forms the execution there. ``agent``: the
        launch whose workers wrote that (``job.json``); one left by an earlier launch is not reported."""
        if agent != self.agent:
            return
        member = (epoch, sorted(ranks), world)
        now = time.monotonic()
        if member == self._reported or now - self._report_tried < self.every_s:
            return
        self._report_tried = now
        event = {"kind": "Member", "epoch": epoch, "ranks": member[1], "world": world}
        if self.agent:
            event["agent"] = self.agent
        try:
            body = {"node": self.me, "events": [event]}  # one short try: the keeper's loop must not wait
            call_master(self.address, self.token, "POST", "/v1/ckpt", body, 1.0, retry_for_s=0)
            self._reported = member
        except (OSError, ValueError, MasterError) as err:
            log.debug("could not report node %s's ranks to the master (%s)", self.me, err)

"""Where a keeper finds the checkpoint decider, and its node's membership report there.

The decider knows the job's membership: the nodes' ranks (each keeper's ``Member``, below) and, from
the job master's presence, a lost node within milliseconds (``launch.presence``) — never a timeout.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from stalwart import runtime
from stalwart.runtime.master_call import MasterError, call_master

log = logging.getLogger("stalwart.checkpoint")


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

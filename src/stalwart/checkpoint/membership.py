"""The job master's word on which nodes are lost, for a persist that waits on other nodes' keepers.

A node whose agent dies is lost at the master within milliseconds (``launch.presence``). A persist
that waits for that node's shards asks here instead of waiting for its storage heartbeat to go stale
(``answer_s``, seconds): the persist is given up within ``every_s`` of the master's loss record (issue
30: a lost node is known from membership, not a timeout). Without a master (plain ``torchrun``) or
when it does not answer, nothing is known lost and the heartbeat rule stands.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

from stalwart import runtime
from stalwart.runtime.master_call import MasterError, call_master

log = logging.getLogger("stalwart.checkpoint")


class NodeLost(LookupError):
    """A node the persist waits on is lost: its ranks' snapshots went with it."""


class LostNodes:
    """Which nodes the master holds lost now (its current state, no clock compared across nodes),
    asked at most every ``every_s``; ``me``: this keeper's node id, named in its snapshot tables."""

    def __init__(self, address: str, token: str, me: str, every_s: float = 0.2, agent: str = "") -> None:
        self.address, self.token, self.me, self.every_s = address.rstrip("/"), token, me, every_s
        self.agent = agent  # this launch of the node's agent (``runtime.ENV_AGENT``): a requeue is a new one
        self._lost: set[str] = set()
        self._lost_ranks: dict[int, str] = {}  # rank → its lost node, for the nodes that reported their ranks
        self._reported: tuple[int, list[int], int] | None = None  # (epoch, ranks, world) the master has
        self._report_tried = -float("inf")
        self._asked = -float("inf")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LostNodes | None:
        """The keeper's under ``stalwart run`` with a master every node shares (master, job token and node
        id in its environment); None otherwise (``desk_host``: rank 0's keeper decides)."""
        env = os.environ if env is None else env
        address, token, me = (env.get(k, "") for k in (runtime.ENV_MASTER, runtime.ENV_JOB_TOKEN, runtime.ENV_NODE_ID))
        if not (address and token and me and env.get(runtime.ENV_SHARED_MASTER) == "1"):
            return None
        log.info("node %s: the job master at %s says which nodes are lost", me, address)
        return cls(address, token, me, agent=env.get(runtime.ENV_AGENT, ""))

    def _call(self, path: str, body: dict | None = None) -> dict:
        """One short try: a master that does not answer must not slow the persist's polling."""
        return call_master(self.address, self.token, "POST" if body else "GET", path, body, 1.0, retry_for_s=0)

    def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._asked < self.every_s:
            return
        self._asked = now
        try:
            lost = self._call("/v1/nodes/lost").get("lost", [])
            self._lost = {str(n["node_id"]) for n in lost}
            self._lost_ranks = {int(r): str(n["node_id"]) for n in lost for r in n.get("ranks") or []}
        except (OSError, ValueError, KeyError, TypeError, MasterError) as err:
            log.debug("could not ask the master for lost nodes (%s); the heartbeat rule decides", err)

    def lost(self, node: str | None) -> bool:
        if not node:
            return False
        self._refresh()
        return node in self._lost

    def report_member(self, epoch: int, ranks: list[int], world: int, agent: str = "") -> None:
        """Tell the master (once per execution; a failed try again after ``every_s``) that this node runs
        ``ranks`` of ``world`` in ``epoch``, so it can name a lost node's ranks: a persist waiting on a
        rank whose node never wrote a word is given up at once, not after ``answer_s``. ``agent``: the
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
            self._call("/v1/ckpt", {"node": self.me, "events": [event]})
            self._reported = member
        except (OSError, ValueError, MasterError) as err:
            log.debug("could not report node %s's ranks to the master (%s)", self.me, err)

    def raise_if_rank_lost(self, rank: int, step: int) -> None:
        self._refresh()
        if (node := self._lost_ranks.get(rank)) is not None:
            raise NodeLost(
                f"persist of step {step} given up: rank {rank}'s node {node} is lost (the job master says so)"
            )

    def raise_if_lost(self, node: str | None, step: int, whose: str) -> None:
        if self.lost(node):
            raise NodeLost(f"persist of step {step} given up: {whose} node {node} is lost (the job master says so)")

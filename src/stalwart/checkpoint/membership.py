"""The job master's word on which nodes are lost, for a persist that waits on other nodes' keepers.

A node whose agent dies is lost at the master within milliseconds (``launch.presence``). A persist
that waits for that node's shards asks here instead of waiting for its storage heartbeat to go stale
(``answer_s``, seconds): the persist is given up within ``every_s`` of the master's loss record (issue
30: a lost node is known from membership, not a timeout). Without a master (plain ``torchrun``) or
when it does not answer, nothing is known lost and the heartbeat rule stands.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.request
from collections.abc import Mapping

from stalwart import runtime

log = logging.getLogger("stalwart.checkpoint")


class NodeLost(LookupError):
    """A node the persist waits on is lost: its ranks' snapshots went with it."""


class LostNodes:
    """Which nodes the master holds lost now (its current state, no clock compared across nodes),
    asked at most every ``every_s``; ``me``: this keeper's node id, named in its snapshot tables."""

    def __init__(self, address: str, token: str, me: str, every_s: float = 0.2) -> None:
        self.address, self.token, self.me, self.every_s = address.rstrip("/"), token, me, every_s
        self._lost: set[str] = set()
        self._asked = -float("inf")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LostNodes | None:
        """The keeper's under ``stalwart run`` (master, job token and node id in its environment); None
        otherwise."""
        env = os.environ if env is None else env
        address, token, me = (env.get(k, "") for k in (runtime.ENV_MASTER, runtime.ENV_JOB_TOKEN, runtime.ENV_NODE_ID))
        if not (address and token and me):
            return None
        return cls(address, token, me)

    def lost(self, node: str | None) -> bool:
        if not node:
            return False
        now = time.monotonic()
        if now - self._asked >= self.every_s:
            self._asked = now
            # One short try per question (the master's client lives in stalwart.launch, a layer above):
            # a master that does not answer must not slow the persist's polling.
            request = urllib.request.Request(
                f"{self.address}/v1/nodes/lost", headers={"Authorization": f"Bearer {self.token}"}
            )
            try:
                with urllib.request.urlopen(request, timeout=1.0) as response:
                    answer = json.loads(response.read())
                self._lost = {str(n["node_id"]) for n in answer.get("lost", [])}
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.debug("could not ask the master for lost nodes (%s); the heartbeat rule decides", err)
        return node in self._lost

    def raise_if_lost(self, node: str | None, step: int, whose: str) -> None:
        if self.lost(node):
            raise NodeLost(f"persist of step {step} given up: {whose} node {node} is lost (the job master says so)")

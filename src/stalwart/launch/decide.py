"""Decide: what the agent does about an incident — restart, fail fast, or leave the job.

The restart budget is the job's, kept by the master (pytorch#108158: TorchElastic counts restarts per
node, so N nodes would get N × the budget). A user error fails fast without asking. When the master
cannot be reached, the agent's local budget (``--max-restarts`` of this node's agent) decides.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stalwart.launch.client import MasterError
from stalwart.launch.detect import Incident

log = logging.getLogger("stalwart.agent")


@dataclass(frozen=True)
class Decision:
    restart: bool
    leave: str | None = None  # the master evicts this node for the failure: leave instead of rejoining
    reason: str = ""


def decide(incident: Incident, ask_master: Callable[[], dict[str, Any]], local_restarts_left: int) -> Decision:
    """``ask_master`` requests one restart from the job's budget (``MasterClient.request_restart``)."""
    if not incident.retry and incident.cls == "storage":
        return Decision(False, reason=f"rank {incident.ranks}: the checkpoint store failed; a restart cannot fix it")
    if not incident.retry:
        return Decision(False, reason=f"rank {incident.ranks} failed with a user error ({incident.kind})")
    try:
        reply = ask_master()
    except (MasterError, OSError) as err:
        log.error("master unreachable for the restart decision (%s); using the local budget", err)
        allowed = local_restarts_left > 0
        return Decision(allowed, reason="master unreachable: local budget " + ("left" if allowed else "used up"))
    leave = str(reply["leave"]) if reply.get("leave") else None
    if not reply["allowed"]:
        return Decision(False, leave, f"restart budget used up ({reply.get('used')}/{reply.get('budget')})")
    return Decision(True, leave, "restart allowed by the job's budget")


def restarts_left(max_restarts: int, used: int) -> int:
    """This agent's local budget (only used while the master is unreachable)."""
    return max(0, max_restarts - used)

"""A parked node (``--autoscale on`` shrank the job): out of the rendezvous, its agent process stays up
and beats as a spare (``member: False``) until the master's autoscaler unparks it — then `stalwart run`
starts a fresh agent that joins the rendezvous, and the members regroup with it at a checkpoint
boundary — or until the job's rendezvous closes (the job finished without it)."""

from __future__ import annotations

import logging
import time
from typing import Any

from stalwart.launch.client import MasterClient, MasterError

log = logging.getLogger("stalwart.agent")


def wait_unparked(client: MasterClient, node_id: str, handler: Any, interval_s: float = 1.0) -> bool:
    """True once the master no longer holds this node parked; False when the rendezvous closed."""
    while True:
        try:
            beat = {"node_id": node_id, "progress": {"member": False, "state": "PARKED"}}
            if not client.call("POST", "/v1/nodes/heartbeat", beat, retry_for_s=0).get("park"):
                return True
        except (MasterError, OSError) as err:  # a restarting master: ask again
            log.debug("parked node %s: heartbeat failed (%s)", node_id, err)
        try:
            if handler.is_closed():
                return False
        except Exception as err:  # the rendezvous store is gone: so is the job
            log.warning("parked node %s: the rendezvous is unreachable (%s); leaving", node_id, err)
            return False
        time.sleep(interval_s)
